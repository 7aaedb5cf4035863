"""The benchmark tool's own pieces (not speed): a seeded mix, the generate double speaking the
wire format, the closed loop's counting, the Markdown/JSON/PNG report, the exactness check's
parsing and comparing, the gateway's and vLLM gRPC server's command lines, CPU accounting, and
one short real run of the gateway target."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from tests.services.generate.test_launcher import thread_cores
from tokenline.launch import servers
from tokenline.launch.bench import (
    cores,
    cpu,
    double,
    lineup,
    load,
    pipeline,
    sse,
)
from tokenline.launch.bench import exactness as ex
from tokenline.launch.bench import gateway as smg
from tokenline.launch.bench.load import (
    EngineTarget,
    OpenAITarget,
    Point,
    Sample,
    Spec,
    Target,
    closed_loop,
    request_mix,
)
from tokenline.launch.bench.metrics import PROXY_COUNTERS
from tokenline.launch.bench.report import markdown, plots
from tokenline.launch.process import Process
from tokenline.services.generate.launcher import ENGINE_CORE
from tokenline.shared.wire import GENERATE_CHUNK, GENERATE_RESPONSE


def test_mix_is_seeded_and_varied() -> None:
    a, b = request_mix(32), request_mix(32)
    assert [s.body for s in a] == [s.body for s in b]
    assert {s.kind for s in a} == {"chat", "completion"}
    assert len({s.body["max_tokens"] for s in a}) > 1
    assert any("logprobs" in s.body for s in a) and not all("logprobs" in s.body for s in a)
    # the goals' setup: every request a chat with top-2 logprobs
    chats = request_mix(16, chat_share=1.0, logprobs_share=1.0)
    assert all(s.kind == "chat" and s.body["top_logprobs"] == 2 for s in chats)


def test_mix_at_one_output_length_is_the_same_mix() -> None:
    """`--max-tokens`: every request asks for that many tokens, and nothing else moves (the
    prompts, kinds and seeds are the mix's own), so two runs differ only in output length."""
    mix, fixed = request_mix(32), request_mix(32, max_tokens=7)
    assert {s.body["max_tokens"] for s in fixed} == {7}
    unfixed = [{**s.body, "max_tokens": 7} for s in mix]
    assert [s.body for s in fixed] == unfixed
    assert [s.kind for s in fixed] == [s.kind for s in mix]
    with pytest.raises(SystemExit):  # no request asks for nothing
        pipeline.main(["--max-tokens", "0"])


async def test_double_speaks_generate_and_the_loop_counts() -> None:
    server = TestServer(double.make_app(vocab=4096, tokens_per_second=0))
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        spec = Spec("chat", {})
        body: dict[str, Any] = {
            "request_id": "r",
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 8, "logprobs": 2, "seed": 1},
        }
        target = EngineTarget("engine", url, {id(spec): body})
        point = await closed_loop(target, [spec], concurrency=3, duration=0.5, progress="t")
        assert point.samples and all(s.ok and s.tokens == 8 for s in point.samples)
        summary = point.summary()
        assert summary["output_tokens_per_s"] == 8 * len(point.samples) / point.seconds
        assert summary["tokens_per_request"] == 8
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/inference/v1/generate", json=body) as resp:
                whole = GENERATE_RESPONSE.decode(await resp.read())
            async with session.post(
                url + "/inference/v1/generate", json={**body, "stream": True}
            ) as resp:
                payloads = [p async for p in sse.aiter_payloads(resp)]
            # the exactness check's reader takes the engine's answers, whole and streamed
            streamed = await ex.ask(
                session, url + "/inference/v1/generate", {**body, "stream": True}
            )
        assert whole.choices[0].token_ids and len(whole.choices[0].token_ids) == 8
        chunks = [GENERATE_CHUNK.decode(p) for p in payloads]
        assert [c.choices[0].token_ids[0] for c in chunks] == whole.choices[0].token_ids  # type: ignore[index]
        assert streamed.token_ids == tuple(whole.choices[0].token_ids)
        assert streamed.entries is not None and len(streamed.entries) == 8
        assert streamed.finish_reason == "length" and streamed.text is None
    finally:
        await server.close()


def test_the_engine_alone_is_asked_for_token_ids_only() -> None:
    """The ceiling gets what tokenline's engine gets: `detokenize: false` (a render leaves
    vLLM's default, and the engine then decoded every token in its server: 177 us of its CPU
    per token against tokenline's 100) and no stop strings."""
    rendered = {
        "request_id": "r",
        "token_ids": [1, 2],
        "sampling_params": {"max_tokens": 4, "stop": ["x"], "detokenize": True, "seed": 3},
    }
    streamed = load.tokens_only(rendered, stream=True)
    assert streamed["sampling_params"] == {"max_tokens": 4, "detokenize": False, "seed": 3}
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    whole = load.tokens_only(rendered, stream=False)
    assert whole["stream"] is False and "stream_options" not in whole
    assert whole["token_ids"] == [1, 2] and rendered["sampling_params"]["stop"] == ["x"]


# --------------------------------------------------------------------------- report


def _point(t: str, c: int, r: float, front: float | None) -> dict[str, Any]:
    return {
        "target": t,
        "level": c,
        "requests_per_s": r * c,
        "output_tokens_per_s": 10 * r * c,
        "ttft_p50_ms": 5.0 / r,
        "ttft_p99_ms": 9.0,
        "itl_p50_ms": 1.0,
        "itl_p99_ms": 2.0,
        "e2e_p50_ms": 50.0,
        "errors": 0.0,
        "output_tokens": 100.0,
        "tokens_per_request": 64.0,
        "cpu_front_us": front,
        "cpu_server_us": 40.0,
        "cpu_core_us": 300.0,
    }


RATES = (("monolithic", 1.25, None), ("engine", 2.0, None), ("tokenline", 1.0, 120.0))
RATES += (("gateway", 0.8, 50.0),)


def test_interpreter_names_this_python_and_how_its_libpython_is_linked() -> None:
    named = cpu.interpreter()
    assert named.startswith(f"Python {platform.python_version()} (")
    assert named.endswith(("libpython shared)", "libpython linked in)"))
    pyenv = (
        "7f97770000-7f97780000 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f97780000-7f97790000 r-xp 00000000 08:01 456 "
        "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0\n"
    )
    assert cpu.libpython_linking(pyenv) == "libpython shared"
    debian = "5600-5700 r-xp 00000000 08:01 789 /usr/bin/python3.11\n"
    assert cpu.libpython_linking(debian) == "libpython linked in"
    assert cpu.libpython_linking("5600-5700 r-xp 00000000 08:01 7 /srv/libpython-notes/x\n") == (
        "libpython linked in"  # a folder of that name is no library
    )


def test_report_files(tmp_path: Path) -> None:
    cases = {"chat, streamed": {"tokenline": {"text": None, "logprobs": None}}}
    cases["chat, streamed"]["gateway"] = {"text": None, "logprobs": "13 entries, vLLM 24 entries"}
    result = {
        "mode": "vllm",
        "load": "c",
        "duration_s": 1.0,
        "requests_in_mix": 4,
        "sequential": True,
        "skipped": {},
        "points": [_point(t, c, r, f) for t, r, f in RATES for c in (1, 4)],
        "exactness": {"cases": cases},
    }
    text = markdown(result)
    assert "asking for 16, 64 or 128 tokens" not in text  # no mix recorded, none described
    mixed = markdown({**result, "chat_share": 1, "logprobs_share": 1, "max_tokens": None})
    assert "100% with top-2 logprobs, asking for 16, 64 or 128 tokens." in mixed
    fixed = markdown({**result, "chat_share": 1, "logprobs_share": 1, "max_tokens": 16})
    assert "100% with top-2 logprobs, every one asking for 16 tokens." in fixed
    assert "ran on" not in text  # no interpreter recorded, none named
    python = "Python 3.11.2 (/usr/bin/python3.11, libpython linked in)"
    assert f"tokenline and vLLM ran on {python}." in markdown({**result, "interpreter": python})
    assert "tokenline/monolithic: output tokens/s 0.80x" in text
    assert "tokenline/engine: output tokens/s 0.50x" in text
    assert "tokenline/gateway: output tokens/s 1.25x" in text
    assert "gateway/monolithic: output tokens/s 0.64x" in text
    assert "goal tokenline >= the gateway: met (1.25x)" in text
    assert "goal tokenline >= 1.0x monolithic with TTFT p50 no worse: not met (0.80x" in text
    # every target side by side, tokenline first; CPU per token where it is spent
    rows = [line for line in text.splitlines() if line.startswith("| ")][:5]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| tokenline",
        "| gateway",
        "| monolithic",
        "| engine",
    ]
    assert "| tokenline | 1.0 | 10 | 0.80x |" in text and "| 120 | 40 | 300 |" in text
    assert "| monolithic | 1.2 | 12 | 1.00x |" in text and "| — | 40 | 300 |" in text
    assert "| chat, streamed | equal | logprobs: 13 entries, vLLM 24 entries |" in text
    assert "tokenline: 1/1 cases equal, gateway: 0/1 cases equal" in text
    written = plots(result, tmp_path)
    assert [p.name for p in written] == [
        "vllm-output_tokens_per_s.png",
        "vllm-ttft_p50_ms.png",
        "vllm-itl_p50_ms.png",
        "vllm-cpu_per_token.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_double_run_checks_the_front_end_goals() -> None:
    result = {
        "mode": "double",
        "load": "c",
        "duration_s": 1.0,
        "points": [_point("tokenline", 64, 1.0, 80.0), _point("engine", 64, 2.0, None)],
    }
    result["points"][0] |= {"itl_p50_ms": 1.25, "output_tokens_per_s": 21_000.0}
    text = markdown(result)
    assert "goal added ITL p50 <= 0.3 ms: met (+0.250 ms)" in text
    assert "goal >= 20,000 output tokens/s through one proxy: met (21,000)" in text
    assert "goal tokenline >=" not in text  # no vLLM peers in a double run


def test_vllm_run_checks_proxy_and_derender_cpu_per_token() -> None:
    """The CPU goal adds proxy and derender (not render) from the per-process split, and is left out
    when the split lacks either of them."""
    points = [_point(t, 16, r, f) for t, r, f in RATES]
    points[2]["cpu_front_parts_us"] = {"bench-proxy": 50.0, "bench-render": 10.0}
    result = {"mode": "vllm", "load": "c", "duration_s": 1.0, "points": points}
    assert "goal proxy + derender" not in markdown(result)
    points[2]["cpu_front_parts_us"]["bench-derender"] = 31.0
    text = markdown(result)
    assert "goal proxy + derender <= 80 us CPU per output token: not met (81.0 us)" in text
    assert "goal tokenline >= the gateway: met (1.25x)" in text  # the other goals stay
    points[2]["cpu_front_parts_us"]["bench-derender"] = 30.0
    assert "goal proxy + derender <= 80 us CPU per output token: met (80.0 us)" in markdown(result)


def test_a_tokenline_point_says_how_full_its_derender_batches_were_and_what_its_hops_took() -> None:
    """The proxy's counters over a point's slices (scraped around each slice), in the point and
    on the report's per-process line; a target without them has none."""
    slices = []
    for chunks, batches, render_s in ((300.0, 20.0, 0.03), (100.0, 10.0, 0.05)):
        p = Point("tokenline", 16, 1.0, [Sample(0.01, [0.001] * 3, 0.1, 4, True)])
        p.proxy = dict.fromkeys(PROXY_COUNTERS, 0.0)
        p.proxy |= {"chunks": chunks, "batches": batches, "render_s": render_s, "renders": 10.0}
        slices.append((p, cpu.Split(0.5, 1.0, (("bench-proxy", 0.3), ("bench-derender", 0.2)))))
    front = [Process("x", ["true"], 0)]
    point = pipeline._point(lineup.Running(OpenAITarget("tokenline", "u"), front, None), slices)
    assert point["chunks_per_batch"] == pytest.approx(400.0 / 30.0)
    assert point["render_hop_ms"] == pytest.approx(4.0)
    assert "derender_hop_ms" not in point  # no derender call counted: no mean made up
    result = {"mode": "vllm", "load": "c", "duration_s": 1.0, "points": [point]}
    assert "13.3 stream chunks per derender batch; render call mean 4.00 ms" in markdown(result)
    for p, _ in slices:
        p.proxy = {}
    point = pipeline._point(lineup.Running(OpenAITarget("monolithic", "u"), [], None), slices)
    assert "chunks_per_batch" not in point and "render_hop_ms" not in point


def test_report_names_a_skipped_target(tmp_path: Path) -> None:
    result = {
        "mode": "vllm",
        "load": "c",
        "duration_s": 1.0,
        "skipped": {"gateway": "--no-gateway"},
        "points": [_point(t, 16, r, f) for t, r, f in RATES if t != "gateway"],
    }
    text = markdown(result)
    assert "gateway: not measured (--no-gateway)" in text
    assert "| gateway |" not in text and "tokenline/gateway" not in text
    written = plots(result, tmp_path)  # one level: bars per target
    assert len(written) == 4 and all(p.read_bytes().startswith(b"\x89PNG") for p in written)


# --------------------------------------------------------------------------- exactness

VLLM_CHUNKS: list[dict[str, Any]] = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]},
    # a token whose bytes are incomplete UTF-8: no text yet, but its logprob entry
    {
        "choices": [
            {
                "delta": {"content": ""},
                "logprobs": {
                    "content": [
                        {
                            "token": "",
                            "logprob": -6.464268684387207,
                            "top_logprobs": [
                                {"token": "", "logprob": -6.464268684387207},
                                {"token": "фД", "logprob": -6.61373233795166},
                            ],
                        }
                    ]
                },
            }
        ]
    },
    {
        "choices": [
            {
                "delta": {"content": "��Д"},
                "logprobs": {
                    "content": [
                        {
                            "token": "Д",
                            "logprob": -6.316317081451416,
                            "top_logprobs": [{"token": "Д", "logprob": -6.316317081451416}],
                        }
                    ]
                },
                "finish_reason": "stop",
                "stop_reason": "ab",
            }
        ]
    },
    {"choices": [], "usage": {"completion_tokens": 2}},
]


def _gateway_chunks() -> list[dict[str, Any]]:
    """What the gateway streams for the same answer: the held-back token's entry dropped,
    logprobs in their shortest float32 form, no stop reason."""
    last = {
        "delta": {"content": "��Д"},
        "logprobs": {
            "content": [
                {
                    "token": "Д",
                    "logprob": -6.316317,
                    "top_logprobs": [{"token": "Д", "logprob": -6.316317}],
                }
            ]
        },
        "finish_reason": "stop",
    }
    return [VLLM_CHUNKS[0], {"choices": [last]}, VLLM_CHUNKS[3]]


def test_streams_reassemble_and_float32_logprobs_compare_equal() -> None:
    want = ex.parse_stream(VLLM_CHUNKS)
    assert want.text == "��Д" and want.finish_reason == "stop" and want.stop_reason == "ab"
    assert want.completion_tokens == 2 and want.entries is not None and len(want.entries) == 2
    assert ex.compare(want, want) == {
        "text": None,
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "completion_tokens": None,
    }
    assert ex.f32(-6.316317) == ex.f32(-6.316317081451416)
    got = ex.parse_stream(_gateway_chunks())
    diffs = ex.compare(want, got)
    assert diffs["text"] is None and diffs["completion_tokens"] is None
    assert diffs["logprobs"] == "1 entries, vLLM 2 entries"
    assert diffs["stop_reason"] == "None, vLLM 'ab'"
    # the same entries, only printed at float32: equal
    only_last = ex.parse_stream([VLLM_CHUNKS[2]])
    assert ex.entries_diff(only_last.entries, got.entries) is None


def test_whole_answers_and_missing_logprobs() -> None:
    vllm_whole = {
        "choices": [
            {
                "text": "ab",
                "logprobs": {
                    "tokens": ["a", "b"],
                    "token_logprobs": [-1.0, -2.0],
                    "top_logprobs": [{"a": -1.0, "x": -3.0}, {"b": -2.0, "y": -2.5}],
                },
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {"completion_tokens": 2},
    }
    want = ex.parse_whole(vllm_whole)
    assert want.entries == (
        ex.Entry("a", -1.0, (("a", -1.0), ("x", -3.0))),
        ex.Entry("b", -2.0, (("b", -2.0), ("y", -2.5))),
    )
    dropped = {"choices": [{"text": "ab", "finish_reason": "length"}], "usage": vllm_whole["usage"]}
    diffs = ex.compare(want, ex.parse_whole(dropped))
    assert diffs["logprobs"] == "no logprobs, vLLM 2 entries"
    assert diffs["stop_reason"] is None  # absent and null are the same for a length finish
    swapped = {"choices": [{**vllm_whole["choices"][0], "text": "ba"}], "usage": {}}  # type: ignore[dict-item]
    assert ex.compare(want, ex.parse_whole(swapped))["text"] == "'ba', vLLM 'ab'"
    assert ex.compare(want, ex.Answer(error="500 boom")) == {"answer": "error: 500 boom"}


def two_of(answer: ex.Answer) -> ex.Answer:
    """`answer` with a top candidate the engine never gave."""
    assert answer.entries is not None
    entry = answer.entries[0]
    return replace(answer, entries=(replace(entry, top=(*entry.top, ("z", -0.5))),))


def test_engine_answers_compare_by_token_id_and_value() -> None:
    want = ex.Answer(
        text="ab",
        entries=(ex.Entry("a", -1.0, (("a", -1.0), ("x", -3.0))),),
        token_ids=(7,),
        finish_reason="length",
        completion_tokens=1,
    )
    engine = ex.Answer(
        entries=(ex.Entry(7, -1.0, ((7, -1.0), (9, -3.0))),),
        token_ids=(7,),
        finish_reason="length",
        completion_tokens=1,
    )
    assert all(v is None for v in ex.compare(want, engine, engine=True).values())
    # vLLM's completions collapse two top candidates that print alike into one key
    collapsed = replace(want, entries=(ex.Entry("a", -1.0, (("", -1.0),)),))
    two = replace(engine, entries=(ex.Entry(7, -1.0, ((7, -1.0), (9, -1.0))),))
    assert ex.compare(collapsed, two, engine=True)["logprobs"] is None
    assert ex.compare(two_of(want), engine, engine=True)["logprobs"] is not None
    other = ex.Answer(**{**engine.__dict__, "token_ids": (8,)})
    assert ex.compare(want, other, engine=True)["token_ids"] == "token IDs differ"


def test_stop_strings_come_from_the_reference_text() -> None:
    assert ex.stop_string("ab cd\ufffdef gh") == "cd"  # from a third of the way in
    assert ex.stop_string("abc d\ufffdef gh") == "ef"  # whole characters only, no space
    assert ex.stop_string("a b c") is None
    base = ex.cases()
    assert {c.name for c in base} == {
        "chat, streamed",
        "chat, whole",
        "completion, streamed",
        "completion, whole",
    }
    assert all(c.body["temperature"] == 0.0 for c in base)
    reference = {
        "chat, streamed": ex.Answer(text="xxxxxxHello"),
        "chat, whole": ex.Answer(text="zz"),
    }
    stops = ex.with_stops(base, reference)
    assert [(c.name, c.body["stop"], c.stream) for c in stops] == [
        ("chat, streamed, stop string", ["xx"], True)
    ]


def test_judge_and_its_table() -> None:
    good = ex.parse_stream(VLLM_CHUNKS)
    answers = {
        "monolithic": {"chat, streamed": good},
        "tokenline": {"chat, streamed": good},
        "gateway": {"chat, streamed": ex.parse_stream(_gateway_chunks())},
    }
    verdicts = ex.judge(answers)
    assert verdicts.matches("tokenline") == (1, 1)
    assert verdicts.matches("gateway") == (0, 1)
    table = ex.markdown(verdicts)
    assert (
        "| chat, streamed | equal "
        "| logprobs: 1 entries, vLLM 2 entries<br>stop_reason: None, vLLM 'ab' |" in table
    )


# --------------------------------------------------------------------------- lineup


def test_gateway_command_line_is_grpc_mode_on_loopback() -> None:
    argv = smg.gateway_argv("/x/smg", 8001, 8002, "grpc://127.0.0.1:9000", Path("/m"))
    assert argv[:2] == ["/x/smg", "launch"]
    pairs = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert pairs["--worker-urls"] == "grpc://127.0.0.1:9000"
    assert pairs["--host"] == pairs["--prometheus-host"] == "127.0.0.1"
    assert pairs["--port"] == "8001" and pairs["--prometheus-port"] == "8002"
    assert pairs["--model-path"] == "/m" and pairs["--policy"] == "passthrough"
    assert "--disable-retries" in argv and "--disable-circuit-breaker" in argv


def test_gateway_engine_runs_the_monolithic_engine_flags(tmp_path: Path) -> None:
    """vLLM behind the gateway gets the reference's engine settings, so answers compare."""
    grpc = servers.grpc_engine("g", tmp_path, "tiny")
    mono = servers.oracle("m", tmp_path, "tiny")

    def flags(argv: list[str]) -> list[str]:
        rest = argv[3:]  # vllm serve MODEL
        i = rest.index("--port")
        return rest[:i] + rest[i + 2 :]

    assert grpc.argv[1:3] == mono.argv[1:3] == ["serve", str(tmp_path)]
    assert flags(grpc.argv) == ["--grpc", *flags(mono.argv)[1:]]
    assert "--dtype" in grpc.argv and grpc.argv[grpc.argv.index("--dtype") + 1] == "float32"
    assert grpc.env is not None and grpc.env["SMG_VLLM_SERVICER_KV_EVENTS"] == "0"
    assert grpc.url.startswith("grpc://127.0.0.1:")


def test_groups_run_together_unless_memory_is_short(tmp_path: Path) -> None:
    assert pipeline.one_at_a_time("auto", engines=3, free_gib=20.0) is False
    assert pipeline.one_at_a_time("auto", engines=3, free_gib=9.0) is True
    assert pipeline.one_at_a_time("yes", engines=0, free_gib=100.0) is True
    assert pipeline.one_at_a_time("no", engines=9, free_gib=1.0) is False
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 24000000 kB\nMemAvailable: 2097152 kB\n")
    assert pipeline.available_gib(meminfo) == 2.0


def _args(**over: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pipeline.add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **over})


def test_plan_skips_the_gateway_when_asked_or_on_the_double(tmp_path: Path) -> None:
    skipped = pipeline.plan(_args(no_gateway=True), tmp_path, [])
    assert (len(skipped.groups), skipped.engines) == (2, 2)
    assert skipped.skipped == {"gateway": "--no-gateway"}
    on_double = pipeline.plan(_args(double=True), tmp_path, [])
    assert len(on_double.groups) == 1 and "gateway" in on_double.skipped
    assert _args().no_gateway is False  # the gateway is on by default


def test_cpu_is_read_from_the_process_tree() -> None:
    """A busy grandchild's CPU counts as its front end's."""
    child = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'while 1: pass'])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child + "; time.sleep(60)"], start_new_session=True
    )
    try:
        front = Process("busy", [], 0, proc=proc)
        time.sleep(0.5)
        before = cpu.sample([front], None)
        time.sleep(1.0)
        used = cpu.sample([front], None) - before
        assert used.front > 0.05
        assert used.server == used.core == 0.0
        assert used.parts == (("busy", used.front),)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    split = cpu.Split(0.5, 2.0, (("proxy", 0.75), ("render", 0.25)))
    assert cpu.per_token(split, 1000, has_front=False) == {
        "cpu_front_us": None,
        "cpu_front_parts_us": {"proxy": 750.0, "render": 250.0},
        "cpu_server_us": 500.0,
        "cpu_core_us": 2000.0,
    }
    assert cpu.per_token(cpu.Split(), 0, has_front=True)["cpu_front_us"] is None


def test_split_cores_pins_each_engine_core_and_nothing_else() -> None:
    """`--split-cores`: every thread of a server's EngineCore process (found by vLLM's process
    title) moves to the last core, the server itself and its other children stay."""
    split = cores.Split.of([0, 1, 2, 3])
    assert split.front == {0, 1, 2} and split.model == {3}
    with pytest.raises(SystemExit):
        cores.Split.of([5])
    with pytest.raises(SystemExit):  # the double has no model to keep apart: refused, not ignored
        pipeline.main(["--split-cores", "--double"])
    here = sorted(os.sched_getaffinity(0))
    assert len(here) >= 2, "this test needs a machine of two cores or more"
    split = cores.Split.of(here)
    titled = (
        "import ctypes, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
        "ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore'); time.sleep(60)"
    )
    tree = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {titled!r}]); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", tree], start_new_session=True)
    try:
        import psutil

        server = Process("engine", [], 0, proc=proc)
        children: list[Any] = []
        for _ in range(50):  # the children start
            children = psutil.Process(proc.pid).children()
            if len(children) == 2 and any(c.name().startswith(ENGINE_CORE) for c in children):
                break
            time.sleep(0.1)
        assert split.pin_models([server, None]) == 1
        for child in children:
            engine = child.name().startswith(ENGINE_CORE)
            assert thread_cores(child) == ({split.model} if engine else {frozenset(here)})
        assert os.sched_getaffinity(proc.pid) == set(here)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --------------------------------------------------------------------------- real gateway


@pytest.mark.fleet  # a vLLM gRPC server
def test_gateway_target_for_real(tiny_model: Path) -> None:
    """One vLLM gRPC server and the gateway: the bench's target streams the mix, and the
    exactness check reads its answers (text equal whole and streamed)."""
    exe = smg.ensure()
    with lineup.gateway(tiny_model, exe) as running:
        (gw,) = running
        assert gw.target.name == "gateway" and gw.front and gw.server is not None

        async def go() -> tuple[Any, dict[str, ex.Answer]]:
            point = await closed_loop(gw.target, request_mix(8), 2, 2.0, "gateway")
            async with aiohttp.ClientSession() as session:
                got = {c.name: await gw.target.answer(session, c) for c in ex.cases(8)}
            return point, {k: v for k, v in got.items() if v is not None}

        point, answers = asyncio.run(go())
        used = cpu.sample(gw.front, gw.server)
    assert point.samples and all(s.ok for s in point.samples)
    assert point.summary()["tokens_per_request"] > 8  # ignore_eos honoured: 16-128 a request
    assert used.front > 0 and used.server > 0 and used.core > 0
    assert answers["chat, streamed"].text == answers["chat, whole"].text
    assert answers["chat, whole"].completion_tokens == 8


class _Echo(Target):
    """Answers every case with the same text; the engine-like one declines stop cases."""

    def __init__(self, name: str, declines_stops: bool = False) -> None:
        self.name = name
        self.declines_stops = declines_stops
        self.asked: list[str] = []

    async def answer(self, session: aiohttp.ClientSession, case: ex.Case) -> ex.Answer | None:
        self.asked.append(case.name)
        return None if self.declines_stops and "stop" in case.body else ex.Answer(text="abcdef")


def test_everyone_is_asked_the_reference_stop_cases() -> None:
    mono, ours, engine = _Echo("monolithic"), _Echo("tokenline"), _Echo("engine", True)
    answers: dict[str, dict[str, ex.Answer]] = {}
    running = [lineup.Running(t, [], None) for t in (mono, ours, engine)]
    asyncio.run(pipeline._answers(running, answers))
    stops = ["chat, streamed, stop string", "completion, streamed, stop string"]
    assert mono.asked == ours.asked == engine.asked == [c.name for c in ex.cases()] + stops
    assert set(answers["monolithic"]) == set(answers["tokenline"]) == set(mono.asked)
    assert set(answers["engine"]) == {c.name for c in ex.cases()}
    assert ex.judge(answers).matches("tokenline") == (6, 6)


def test_rounds_take_turns_and_add_up(monkeypatch: Any) -> None:
    """A point in rounds is the targets' slices in turn (each round led by the next target),
    each going on through the mix where the target's last one stopped, summed into one point
    per target: requests, seconds and CPU over every slice."""
    calls: list[tuple[str, float, int]] = []

    async def slice_of(
        target: Target, mix: list[Spec], c: int, duration: float, label: str, first: int = 0
    ) -> Any:
        calls.append((target.name, round(duration, 6), first))
        k = 3 if target.name == "a" else 5
        return pipeline.Point(target.name, c, duration, [Sample(0.1, [0.01], 0.2, 2, True)] * k)

    monkeypatch.setattr(pipeline, "closed_loop", slice_of)
    running = [lineup.Running(_Echo(n), [], None) for n in ("a", "b")]
    args = argparse.Namespace(rounds=3, duration=0.6, rate=None, concurrency=[2])
    points = pipeline.measure(running, [Spec("chat", {})], args)
    warm_ups = [("a", 3, 0), ("b", 3, 0)]
    slices = [("a", 0.2, 0), ("b", 0.2, 0), ("b", 0.2, 5), ("a", 0.2, 3), ("a", 0.2, 6)]
    assert calls == warm_ups + slices + [("b", 0.2, 10)]
    a, b = points
    assert (a["target"], a["output_tokens"], a["requests_per_s"]) == ("a", 18, 9 / 0.6)
    assert (b["target"], b["output_tokens"], b["requests_per_s"]) == ("b", 30, 15 / 0.6)
    split = cpu.Split(1.0, 2.0, (("proxy", 0.5),)) + cpu.Split(0.5, 0.5, (("proxy", 0.25),))
    assert split == cpu.Split(1.5, 2.5, (("proxy", 0.75),))
