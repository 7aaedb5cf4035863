"""`/v1/responses` through tokenline against vLLM's own, on the fleet's `oracle_hermes` engine
(tiny-qwen3, hermes tool parser, qwen3 reasoning): the official `openai` client (whole,
streamed, a function tool, a follow-up after a proxy restart), the stored responses per key and
across two proxies, and bad input."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import HERMES_QWEN3, Fleet
from tests.proxy.conftest import Pipeline, _key_file, start_pipeline
from tests.proxy.store.conftest import pg_server, pg_url  # noqa: F401 (fixtures)
from tokenline.launch import servers
from tokenline.launch.servers import Server

KEY_A, KEY_B = "responses-key-a", "responses-key-b"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}"\}\}\n</tool_call>'
)
THINK = "<think>\n[a-z]{3,9} [a-z]{3,9}\n</think>\n\nok [a-z]{2,5}"
PICK = {
    "type": "object",
    "properties": {"a": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["a"],
    "additionalProperties": False,
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
BASE = {"model": "tiny-qwen3", "temperature": 0.0, "max_output_tokens": 40}


@dataclass
class Responses:
    pipeline: Pipeline
    store: str
    proxies: list[Server]

    def proxy(self, name: str, key: str, store: str | None = None) -> Server:
        """Another proxy in front of the same hops (and, unless told, the same store)."""
        p = self.pipeline
        proxy = servers.tokenline(
            name,
            "proxy",
            "--render",
            p.render.url,
            "--derender",
            *(d.url for d in p.derenders),
            "--decode",
            *self.decode,
            "--api-key-file",
            str(_key_file(name, key)),
            "--store",
            store or self.store,
        )
        proxy.start().wait(30)
        self.proxies.append(proxy)
        return proxy

    decode: tuple[str, ...] = ()


@pytest.fixture(scope="module")
def responses(
    fleet: Fleet, qwen3_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Responses]:
    store = str(tmp_path_factory.mktemp("responses") / "responses.db")
    p = start_pipeline(
        "responses",
        qwen3_model,
        [fleet.oracle_hermes.url],
        served="tiny-qwen3",
        render_args=HERMES_QWEN3,
        derender_args=HERMES_QWEN3,
        api_key=KEY_A,
        extra=("--store", store),
    )
    r = Responses(p, store, [], (fleet.oracle_hermes.url,))
    yield r
    for s in [*p.all(), *r.proxies]:
        s.stop()


CLIENTS: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _closed_clients() -> Iterator[None]:
    yield
    while CLIENTS:
        CLIENTS.pop().close()


def client(server: Server, key: str = KEY_A) -> openai.OpenAI:
    CLIENTS.append(openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0))
    return CLIENTS[-1]


def oracle(fleet: Fleet) -> openai.OpenAI:
    return client(fleet.oracle_hermes, "x")


def forced(pattern: str, **extra: Any) -> dict[str, Any]:
    """A regex the output must match, with thinking off (the template closes the think block:
    with a reasoning parser, a constraint applies after the reasoning only)."""
    body = {"structured_outputs": {"regex": pattern}, **NO_THINKING}
    return {**BASE, "extra_body": body, **extra}


def shape(response: Any) -> list[tuple[Any, ...]]:
    """What both answers must agree on: each output item's type and its text or call."""
    out: list[tuple[Any, ...]] = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.role, item.status, [c.text for c in item.content]))
        elif item.type == "reasoning":
            out.append(("reasoning", [c.text for c in item.content or ()]))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments), item.status))
    return out


def usage(response: Any) -> tuple[int, int, int, int]:
    u = response.usage
    return (
        u.input_tokens,
        u.output_tokens,
        u.total_tokens,
        u.output_tokens_details.reasoning_tokens,
    )


CASES = {
    "text": dict(input="Say something.", **forced("ok [a-z]{2,9}")),
    "reasoning": dict(input=[{"role": "user", "content": "Think first."}], **forced(THINK)),
    "thinking": dict(input="Think.", **{**BASE, "max_output_tokens": 12}),
    "tool": dict(
        input="What is the weather in Paris?",
        tools=[WEATHER],
        instructions="Use the tools.",
        **forced(CALL),
    ),
    "json": dict(
        input="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": PICK, "strict": True}},
        **{**BASE, "extra_body": NO_THINKING},
    ),
    "tool_result": dict(
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[WEATHER],
        **forced("It is [a-z]{3,8}"),
    ),
}


def keys(raw: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """The Response's keys in order, and its usage details' (as sent, before the SDK)."""
    usage = raw["usage"]
    return list(raw), list(usage["input_tokens_details"]), list(usage["output_tokens_details"])


@pytest.mark.parametrize("case", list(CASES))
def test_whole_responses_equal_vllms(responses: Responses, fleet: Fleet, case: str) -> None:
    mine = client(responses.pipeline.proxy).responses.with_raw_response.create(
        **CASES[case], store=False
    )
    vllms = oracle(fleet).responses.with_raw_response.create(**CASES[case], store=False)
    assert keys(mine.http_response.json()) == keys(vllms.http_response.json())
    ours, theirs = mine.parse(), vllms.parse()
    if case == "json":  # the schema's grammar applied (the tiny model then writes whitespace)
        assert ours.output_text.startswith("{")
    assert shape(ours) == shape(theirs)
    assert usage(ours) == usage(theirs)
    assert (ours.status, ours.object, ours.model) == (theirs.status, theirs.object, theirs.model)
    assert ours.id.startswith("resp_") and [i.id[:3] for i in ours.output] == [
        i.id[:3] for i in theirs.output
    ]


def events(stream: Any) -> list[Any]:
    return list(stream)


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_responses_equal_vllms(responses: Responses, fleet: Fleet, case: str) -> None:
    ours = events(
        client(responses.pipeline.proxy).responses.create(**CASES[case], store=False, stream=True)
    )
    theirs = events(oracle(fleet).responses.create(**CASES[case], store=False, stream=True))
    # the deltas' count follows how the text was cut, which a stream does not fix
    kinds = [e.type for e in ours if not e.type.endswith(".delta")]
    assert kinds == [e.type for e in theirs if not e.type.endswith(".delta")]
    assert [e.sequence_number for e in ours] == list(range(len(ours)))
    assert shape(ours[-1].response) == shape(theirs[-1].response)
    # vLLM's streamed count of reasoning tokens is one short of its whole answer's (which
    # tokenline's whole and streamed answers both give): compared without it
    assert usage(ours[-1].response)[:3] == usage(theirs[-1].response)[:3]
    whole = oracle(fleet).responses.create(**CASES[case], store=False)
    assert usage(ours[-1].response) == usage(whole)
    for kind in ("response.output_text.delta", "response.reasoning_text.delta"):
        text = "".join(e.delta for e in ours if e.type == kind)
        assert text == "".join(e.delta for e in theirs if e.type == kind)


def test_follow_up_after_a_restart_and_on_another_proxy(responses: Responses) -> None:
    first = client(responses.pipeline.proxy).responses.create(**CASES["tool"])
    (call,) = [i for i in first.output if i.type == "function_call"]
    responses.pipeline.proxy.stop()
    responses.pipeline.proxy.start().wait(30)  # a restart: only the database remembers
    follow = dict(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
        previous_response_id=first.id,
        **forced("It is [a-z]{3,8}"),
    )
    ours = client(responses.pipeline.proxy).responses.create(**follow)
    assert ours.previous_response_id == first.id and ours.status == "completed"
    again = client(responses.proxy("responses-proxy-2", KEY_A)).responses.retrieve(ours.id)
    assert again.model_dump() == ours.model_dump()
    # the same conversation spelled out in full, for vLLM: the same answer
    stored = client(responses.pipeline.proxy).responses.create(
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *[i.model_dump() for i in first.output],
            *follow["input"],
        ],
        tools=[WEATHER],
        store=False,
        **forced("It is [a-z]{3,8}"),
    )
    assert shape(stored) == shape(ours) and usage(stored) == usage(ours)


def test_streamed_follow_up(responses: Responses) -> None:
    first = client(responses.pipeline.proxy).responses.create(**CASES["text"], stream=True)
    done = events(first)[-1].response
    follow = client(responses.pipeline.proxy).responses.create(
        input="And then?", previous_response_id=done.id, **forced("ok [a-z]{2,9}")
    )
    assert follow.status == "completed"
    assert client(responses.pipeline.proxy).responses.retrieve(done.id).output[0].id == (
        done.output[0].id
    )


def test_a_request_without_a_model_shows_the_served_one(responses: Responses) -> None:
    body = {k: v for k, v in CASES["text"].items() if k != "model"}
    stream = events(client(responses.pipeline.proxy).responses.create(**body, stream=True))
    assert {e.response.model for e in stream if hasattr(e, "response")} == {"tiny-qwen3"}


def test_another_key_sees_nothing(responses: Responses) -> None:
    mine = client(responses.pipeline.proxy).responses.create(**CASES["text"])
    theirs = client(responses.proxy("responses-proxy-b", KEY_B), KEY_B)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as caught:
        theirs.responses.create(input="go on", previous_response_id=mine.id, **BASE)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    assert client(responses.pipeline.proxy).responses.retrieve(mine.id).id == mine.id


def test_delete_and_cancel(responses: Responses) -> None:
    ours = client(responses.pipeline.proxy)
    made = ours.responses.create(**CASES["text"])
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        ours.responses.cancel(made.id)
    ours.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        ours.responses.retrieve(made.id)


def test_bad_input_is_named(responses: Responses) -> None:
    ours = client(responses.pipeline.proxy)
    with pytest.raises(openai.BadRequestError) as caught:
        ours.responses.create(input=[{"type": "web_search_call", "id": "ws_1"}], **BASE)
    assert caught.value.body["param"] == "input[0].type"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        ours.responses.create(input="x", previous_response_id="resp_nope", **BASE)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="store") as background:
        ours.responses.create(input="x", background=True, store=False, **BASE)
    assert background.value.body["param"] == "background"  # type: ignore[index]


def test_a_store_that_is_down_is_a_503_and_nothing_is_reported_saved(
    responses: Responses,
) -> None:
    down = responses.proxy("responses-proxy-down", KEY_A, store="postgresql://x@127.0.0.1:9/x")
    ours = client(down)
    with pytest.raises(openai.InternalServerError) as caught:
        ours.responses.create(**CASES["text"])
    assert caught.value.status_code == 503
    stream = events(ours.responses.create(**CASES["text"], stream=True))
    assert stream[-1].type == "error" and "store" in stream[-1].message
    assert not any(e.type == "response.completed" for e in stream)
    # every item was closed before the save was tried; the error follows in sequence
    assert stream[-2].type == "response.output_item.done"
    assert [e.sequence_number for e in stream] == list(range(len(stream)))
    assert ours.responses.create(**CASES["text"], store=False).status == "completed"


def test_two_proxies_share_a_postgresql_store(
    responses: Responses,
    pg_url: str,  # noqa: F811 (the fixture imported above)
) -> None:
    """The deployment's case: proxies on one PostgreSQL, each continuing the other's."""
    one = client(responses.proxy("responses-pg-1", KEY_A, store=pg_url))
    two = client(responses.proxy("responses-pg-2", KEY_A, store=pg_url))
    first = one.responses.create(**CASES["tool"])
    (call,) = [i for i in first.output if i.type == "function_call"]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    follow = two.responses.create(
        input=result,
        tools=[WEATHER],
        previous_response_id=first.id,
        **forced("It is [a-z]{3,8}"),
    )
    assert one.responses.retrieve(follow.id).model_dump() == follow.model_dump()
    assert two.responses.retrieve(first.id).model_dump() == first.model_dump()


def until(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return got


@pytest.mark.parametrize("case", ["reasoning", "tool"])
def test_background_ends_as_the_foreground_answer(responses: Responses, case: str) -> None:
    ours = client(responses.pipeline.proxy)
    queued = ours.responses.create(**CASES[case], background=True)
    assert (queued.status, queued.output, queued.usage, queued.background) == (
        "queued",
        [],
        None,
        True,
    )
    done = until(lambda: (r := ours.responses.retrieve(queued.id)).status != "queued" and r)
    fore = ours.responses.create(**CASES[case])
    assert (done.status, fore.status) == ("completed", "completed")
    assert shape(done) == shape(fore) and usage(done) == usage(fore)
    assert (done.created_at, done.background, fore.background) == (queued.created_at, True, False)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        ours.responses.cancel(queued.id)
    unnamed = {k: v for k, v in CASES[case].items() if k != "model"}
    assert ours.responses.create(**unnamed, background=True).model == "tiny-qwen3"


def generating(engine: Server) -> float:
    """How many requests vLLM is generating for (its `num_requests_running` gauge)."""
    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert found is not None
    return float(found.group(1))


def test_a_cancel_on_another_proxy_aborts_vllm(
    responses: Responses,
    fleet: Fleet,
    pg_url: str,  # noqa: F811 (the fixture imported above)
) -> None:
    """Two proxies on one PostgreSQL: a background response started on one and cancelled on
    the other stops within the runner's heartbeat, and vLLM aborts the generation."""
    one = client(responses.proxy("responses-bg-1", KEY_A, store=pg_url))
    two = client(responses.proxy("responses-bg-2", KEY_A, store=pg_url))
    long = {**BASE, "max_output_tokens": 1600}  # a minute or more of the tiny model's thinking
    queued = one.responses.create(input="Write.", background=True, **long)
    until(lambda: generating(fleet.oracle_hermes) >= 1, timeout=30)
    assert one.responses.retrieve(queued.id).status == "queued"
    cancelled = two.responses.cancel(queued.id)
    assert (cancelled.id, cancelled.status, cancelled.output) == (queued.id, "cancelled", [])
    asked = time.monotonic()
    # generating for nothing else now: the engine dropped the request (other tests' are short)
    until(lambda: generating(fleet.oracle_hermes) == 0, timeout=10)
    assert time.monotonic() - asked < 10
    assert one.responses.retrieve(queued.id).status == "cancelled"  # not overwritten
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        one.responses.cancel(queued.id)
    # vLLM keeps a cancelled response's input: a follow-up of it goes on from there
    follow = two.responses.create(
        input="Go on.", previous_response_id=queued.id, **forced("ok [a-z]{2,9}")
    )
    assert follow.status == "completed" and follow.previous_response_id == queued.id
