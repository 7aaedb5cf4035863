"""`tokenline bench routing`: its seeded workloads, its client (against an in-process fake
chat server) and its report math. The benchmark itself starts engines and runs by hand."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from aiohttp import web

from tokenline.launch.bench import routing
from tokenline.launch.bench.conversations import (
    ADAPTERS,
    DOCUMENT_WORDS,
    Reply,
    Session,
    Workload,
    adapters,
    agent,
    body,
    chat,
    drive,
    hot,
    sentences,
)
from tokenline.launch.bench.metrics import samples
from tokenline.launch.bench.routing import (
    EngineCounts,
    adapter_spread,
    engine_counts,
    headline,
    markdown,
    percentile,
    routing_gauges,
    summary,
    verdicts,
)
from tokenline.launch.cli import main as cli

# --------------------------------------------------------------------------- workloads


@pytest.mark.parametrize("make", [chat, agent, hot, adapters])
def test_a_workload_is_the_same_for_a_seed_and_another_for_another(make: Any) -> None:
    assert make(0) == make(0)
    assert make(0) != make(1)


def test_sentences_hold_the_words_asked_for() -> None:
    rng = random.Random(3)
    for words in (1, 6, 15, 250):
        assert len(sentences(rng, words).split()) == words


def requests_of(session: Session, answers: list[str]) -> list[list[dict[str, Any]]]:
    return [session.messages(k, answers) for k in range(len(session.asks))]


@pytest.mark.parametrize("make", [chat, agent, adapters])
def test_each_request_extends_the_one_before_with_its_answer_and_a_new_ask(make: Any) -> None:
    for session in make(0).sessions:
        answers = [f"answer {k}" for k in range(len(session.asks))]
        sent = requests_of(session, answers)
        for k in range(1, len(sent)):
            assert sent[k][: len(sent[k - 1])] == sent[k - 1]  # the prefix the cache can hold
            assert sent[k][len(sent[k - 1]) :] == [
                {"role": "assistant", "content": answers[k - 1]},
                {"role": "user", "content": session.asks[k]},
            ]


def test_chat_is_eight_conversations_of_five_turns_behind_one_system_prompt() -> None:
    w = chat(0)
    assert (len(w.sessions), w.requests, w.concurrency) == (8, 40, 8)
    systems = {json.dumps(s.opening) for s in w.sessions}
    assert len(systems) == 1 and w.sessions[0].opening[0]["role"] == "system"
    assert len({s.asks for s in w.sessions}) == 8
    for s in w.sessions:
        assert 0 <= s.pauses[0] <= 0.5  # staggered starts
        assert all(0.5 <= p <= 2.0 for p in s.pauses[1:])  # users pause between turns


def test_agents_share_one_long_tool_result_and_ask_their_own_questions() -> None:
    w = agent(0)
    assert len(w.sessions) == 4 and w.concurrency == 4
    assert len({json.dumps(s.opening) for s in w.sessions}) == 1
    tool = [m for m in w.sessions[0].opening if m["role"] == "tool"]
    assert len(tool) == 1 and len(tool[0]["content"].split()) == DOCUMENT_WORDS
    call = w.sessions[0].opening[2]["tool_calls"][0]
    assert call["id"] == tool[0]["tool_call_id"]
    asks = [a for s in w.sessions for a in s.asks]
    assert len(set(asks)) == len(asks) == 20


def test_adapters_spread_conversations_over_three_adapters_and_the_base_model() -> None:
    w = adapters(0)
    assert (len(w.sessions), w.requests, w.concurrency, w.adapters) == (16, 48, 8, ADAPTERS)
    models = [s.model for s in w.sessions]
    assert {m: models.count(m) for m in models} == {"tiny": 4, "a1": 4, "a2": 4, "a3": 4}
    # each model a system prompt of its own, shared by its conversations
    for model in ("tiny", *ADAPTERS):
        openings = {json.dumps(s.opening) for s in w.sessions if s.model == model}
        assert len(openings) == 1 and model in next(iter(openings))
    assert body([], 8, "a2")["model"] == "a2"
    assert all(s.model == "tiny" for s in chat(0).sessions)  # the others: the base model


def test_hot_prefix_is_many_one_shot_requests_behind_one_prefix() -> None:
    w = hot(0)
    assert (len(w.sessions), w.requests, w.concurrency) == (64, 64, 16)
    assert len({json.dumps(s.opening) for s in w.sessions}) == 1
    assert len({s.asks for s in w.sessions}) == 64
    assert len(w.sessions[0].opening[0]["content"].split()) >= 1000


# --------------------------------------------------------------------------- the client


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


async def test_sessions_append_the_answers_they_got_and_stop_at_a_failure(
    aiohttp_server: Any,
) -> None:
    seen: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        turn = sum(m["role"] == "user" for m in body["messages"])
        if body["messages"][0]["content"] == "broken" and turn == 2:
            return web.json_response({"error": "no"}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        delta = {"choices": [{"index": 0, "delta": {"content": f"A{turn}"}}]}
        await resp.write(sse(delta, {"choices": [], "usage": {"completion_tokens": 3}}))
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    server = await aiohttp_server(app)
    sessions = tuple(
        Session(name, ({"role": "system", "content": name},), ("q1", "q2", "q3"), (0, 0, 0))
        for name in ("fine", "broken")
    )
    replies, seconds = await drive(
        str(server.make_url("")).rstrip("/"), Workload("t", sessions, 3, 1)
    )
    assert seconds > 0
    fine = [b["messages"] for b in seen if b["messages"][0]["content"] == "fine"]
    assert fine[-1][1:] == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "q3"},
    ]
    assert all(b["max_tokens"] == 3 and b["temperature"] == 0 for b in seen)
    assert len(replies) == 3 + 2  # the broken session's third turn never went
    errors = [r.error for r in replies if r.error is not None]
    assert len(errors) == 1 and errors[0].startswith("HTTP 503")
    assert sum(r.tokens for r in replies) == 4 * 3


# --------------------------------------------------------------------------- report math


def page(queries: float, hits: float, prompt: float) -> str:
    labels = '{engine="0",model_name="tiny"}'
    return (
        f"vllm:prefix_cache_queries_total{labels} {queries}\n"
        f"vllm:prefix_cache_hits_total{labels} {hits}\n"
        f"vllm:prompt_tokens_total{labels} {prompt}\n"
        f"vllm:prefix_cache_queries_created{labels} 1.7e9\n"
        f'vllm:request_success_total{{engine="0",finished_reason="length"}} {prompt / 100}\n'
        f'vllm:request_success_total{{engine="0",finished_reason="stop"}} 1.0\n'
    )


def test_engine_counts_are_what_the_counters_did_between_two_pages() -> None:
    got = engine_counts(samples(page(1000, 400, 1000)), samples(page(3000, 2100, 3000)))
    assert got == EngineCounts(queries=2000, hits=1700, prompt_tokens=2000, requests=20)


def reply(ttft: float, tokens: int = 10, error: str | None = None) -> Reply:
    return Reply(ttft, ttft + 1, tokens, "x", error)


def test_summary_sums_the_engines_and_times_the_good_replies() -> None:
    engines = [EngineCounts(1000, 900, 1000, 3), EngineCounts(3000, 1500, 3000, 9)]
    replies = [reply(t / 1000) for t in range(1, 11)] + [reply(9.0, 50, error="HTTP 500")]
    got = summary(replies, 2.0, engines)
    assert got["hit_rate"] == 2400 / 4000
    assert got["computed_tokens"] == 1600
    assert got["replica_prompt_tokens"] == [1000, 3000]
    assert got["busiest_x_mean"] == 1.5  # 3000 / 2000
    assert got["replica_requests"] == [3, 9] and got["busiest_share"] == 0.75
    assert (got["requests"], got["errors"]) == (11, 1)
    assert got["ttft_p50_ms"] == pytest.approx(6.0)  # nearest rank, the failure left out
    assert got["ttft_p90_ms"] == pytest.approx(10.0)
    assert got["output_tokens_per_s"] == 50.0  # 100 good tokens over 2 s


def test_a_measurement_that_queried_nothing_has_no_hit_rate_and_no_busiest() -> None:
    got = summary([], 1.0, [EngineCounts(0, 0, 0)])
    assert (got["hit_rate"], got["busiest_x_mean"], got["ttft_p50_ms"]) == (0.0, 0.0, 0.0)
    assert got["busiest_share"] == 0.0
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.0) == 1.0


def row(workload: str, target: str, hit_rate: float, busiest: float = 1.0) -> dict[str, Any]:
    return {"workload": workload, "target": target, "hit_rate": hit_rate, "busiest_x_mean": busiest}


def test_headline_compares_cache_aware_with_one_replica_and_the_gateway() -> None:
    rows = [
        row("chat", "one replica", 0.80),
        row("chat", "cache-aware", 0.78),
        row("chat", "gateway", 0.60),
        row("hot", "one replica", 0.90),
        row("hot", "cache-aware", 0.85, busiest=1.6),
    ]
    heads = headline(rows)
    assert heads["chat"] == {
        "busiest_x_mean": 1.0,
        "vs_one_replica": pytest.approx(0.975),
        "vs_gateway": pytest.approx(1.3),
    }
    assert "vs_gateway" not in heads["hot"]  # not measured: no ratio, not a made-up one
    assert verdicts(heads) == [
        "chat: vs_one_replica 0.975x (goal >= 0.95x): met",
        "chat: vs_gateway 1.300x (goal >= 1.0x): met",
        "hot: busiest_x_mean 1.600x (goal <= 1.5x): MISSED",
    ]


def test_the_proxys_routing_gauges_are_read_by_replica_name() -> None:
    replica = 'replica="http://127.0.0.1:9"'
    text = (
        'tokenline_proxy_routing{pool="decode",what="kv_event_batches"} 42.0\n'
        'tokenline_proxy_routing{pool="decode",what="hits"} 7.0\n'
        'tokenline_proxy_routing{pool="prefill",what="hits"} 99.0\n'
        f'tokenline_proxy_routed_prompt_tokens{{pool="decode",{replica}}} 5e3\n'
        f'tokenline_proxy_routed_requests{{pool="decode",{replica},adapter="a1"}} 4.0\n'
        f'tokenline_proxy_routed_requests{{pool="decode",{replica},adapter=""}} 2.0\n'
    )
    names = {"http://127.0.0.1:9": "engine-1"}
    got = routing_gauges(samples(text), names)
    assert got == {
        "kv_event_batches": 42.0,
        "hits": 7.0,
        "routed to engine-1": 5000.0,
        "a1 requests to engine-1": 4.0,
        "base requests to engine-1": 2.0,
    }
    assert adapter_spread(got | {"a2 requests to engine-0": 0.0}) == {
        "a1": {"engine-1": 4},
        "base": {"engine-1": 2},
    }


def test_the_adapters_verdict_is_that_no_replica_took_every_request() -> None:
    rows = [
        {**row("adapters", "cache-aware", 0.5, busiest=1.2), "busiest_share": 0.4},
        {**row("chat", "cache-aware", 0.5), "busiest_share": 1.0},
    ]
    heads = headline(rows)
    assert heads["adapters"]["busiest_share"] == 0.4 and "busiest_share" not in heads["chat"]
    assert verdicts(heads)[0] == "adapters: busiest_share 0.400x (goal < 1.0x): met"
    rows[0]["busiest_share"] = 1.0
    assert verdicts(headline(rows))[0] == "adapters: busiest_share 1.000x (goal < 1.0x): MISSED"


def test_the_report_shows_every_row_and_says_what_was_not_measured() -> None:
    measured = summary([reply(0.01)], 1.0, [EngineCounts(100, 50, 100), EngineCounts(0, 0, 0)])
    rows = [
        {"workload": "chat", "target": t, **measured, "routing": {}, "first_errors": []}
        for t in ("one replica", "cache-aware")
    ]
    rows[1]["routing"] = {"kv_event_batches": 12.0, "kv_event_lag_seconds": 0.0123}
    rows[1] |= {"replicas_down": 2, "log": "proxy.log"}
    result = {
        "replicas": 2,
        "cpu_cores": True,
        "rows": rows,
        "verdicts": verdicts(headline(rows)),
        "skipped": {"gateway": "--no-gateway"},
    }
    text = markdown(result)
    assert "2 replicas, one core per engine" in text
    assert "| chat | cache-aware | 0.500 | 1.00x | 50 of 100 | 10 / 10 ms |" in text
    assert "| 100 / 0 | 2.00x | 0 |" in text
    assert "- gateway not measured: --no-gateway" in text
    assert "- chat: kv_event_batches 12, kv_event_lag_seconds 0.0123" in text
    assert (
        "- chat through cache-aware: the proxy took a replica out of the rotation 2 times" in text
    )
    assert "adapters, requests per replica" not in text  # no adapters workload measured


def test_the_report_shows_where_each_adapters_requests_went() -> None:
    measured = summary(
        [reply(0.01)], 1.0, [EngineCounts(100, 50, 100, 6), EngineCounts(0, 0, 0, 2)]
    )
    rows = [
        {"workload": "adapters", "target": t, **measured, "routing": {}, "first_errors": []}
        for t in ("one replica", "cache-aware")
    ]
    rows[1]["routing"] = {"a1 requests to engine-1": 6.0, "base requests to engine-0": 2.0}
    result = {"replicas": 2, "cpu_cores": False, "rows": rows, "verdicts": [], "skipped": {}}
    text = markdown(result)
    assert "- cache-aware: 6 / 2 (busiest 75%)" in text
    assert "- a1: engine-1 6\n- base: engine-0 2" in text


def test_tokenline_bench_routing_reaches_this_benchmark() -> None:
    with pytest.raises(SystemExit) as exit_:
        cli(["bench", "routing", "--replicas", str(routing.MAX_ENGINES + 1)])
    assert exit_.value.code == 2  # its own parser refused, before starting anything
