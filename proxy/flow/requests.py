"""What the proxy asks of each hop (pure, sans-IO): the engine request built from render's
output and the P/D prefill leg's variant of it, the fields that need a tokenizer or a
constraint, engine and public ids, and the client's headers that travel on.
`proxy/flow/stream.py` and `proxy/flow/hops.py` use it with real hops; tests with plain values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenline.shared.kinds import Kind
from tokenline.shared.limits import MAX_LOGPROBS
from tokenline.shared.wire import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChunk,
    CompletionRequest,
    GenerateRequest,
    SamplingParams,
)

ClientRequest = ChatCompletionRequest | CompletionRequest
ClientChunk = ChatCompletionChunk | CompletionChunk


PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# --------------------------------------------------------------------------- engine requests


def engine_request(
    gen: GenerateRequest, kind: Kind, stream: bool, kv: dict[str, Any] | None
) -> GenerateRequest:
    """The render output as the engine must see it: token IDs out, never text.

    `detokenize: false` always (an engine with a tokenizer would otherwise decode every token
    for nothing). Stop strings are derender's job (a tokens-only vLLM refuses them). Completions
    ask the engine for one more logprob than the client: vLLM 0.32 cuts candidates to
    `logprobs`, and monolithic vLLM shows the sampled token besides the top `logprobs` (derender
    filters by rank). Behind a prefill leg (`kv` set) the decode never runs the prompt, so
    prompt logprobs come from the prefill leg.
    """
    params = gen.sampling_params
    changes: dict[str, Any] = {
        "stop": None,
        "include_stop_str_in_output": False,
        "detokenize": False,
    }
    if kv is not None:
        changes["prompt_logprobs"] = None
    if kind.logprobs_include_sampled and params.logprobs is not None and params.logprobs >= 0:
        changes["logprobs"] = min(params.logprobs + 1, MAX_LOGPROBS)
    extra = dict(params.extra_args or {})
    extra.pop("kv_transfer_params", None)
    changes["extra_args"] = extra or None
    return msgspec.structs.replace(
        gen,
        sampling_params=msgspec.structs.replace(params, **changes),
        stream=stream,
        stream_options=None,
        kv_transfer_params=kv,
    )


def prompt_request(gen: GenerateRequest) -> GenerateRequest:
    """A stream's "prompt leg": one token, not streamed, only for the prompt logprobs that a
    stream echoing its prompt with logprobs shows first and a generate stream never carries.

    Sampling does not matter (prompt logprobs come from the raw logits), so nothing of the
    client's is kept but the prompt and the number of candidates; a request with prompt
    logprobs never reads the prefix cache, so they come out as the stream's own would.
    """
    params = SamplingParams(
        max_tokens=1, prompt_logprobs=gen.sampling_params.prompt_logprobs, detokenize=False
    )
    return msgspec.structs.replace(
        gen,
        request_id=f"{gen.request_id}-prompt",
        sampling_params=params,
        stream=False,
        stream_options=None,
        return_token_ids=None,
        kv_transfer_params=None,
    )


def prefill_request(gen: GenerateRequest) -> GenerateRequest:
    """The P/D prefill leg of `gen` as the engine sees it (`engine_request`): one token, KV
    kept for a remote decode. Its token is sampled as the decode leg's first one will be (the
    same `min_tokens` up to 1, the same logprobs, the same `extra_args` that custom logits
    processors read): a stream may show it first (`proxy/flow/first_token.py`)."""
    params = msgspec.structs.replace(
        gen.sampling_params,
        max_tokens=1,
        min_tokens=min(gen.sampling_params.min_tokens, 1),
        n=1,
        stop=None,
        detokenize=False,
    )
    return msgspec.structs.replace(
        gen,
        sampling_params=params,
        stream=False,
        stream_options=None,
        kv_transfer_params=dict(PREFILL_PARAMS),
    )


# --------------------------------------------------------------------------- engine capabilities


def needs_tokenizer(client: ClientRequest, gens: list[GenerateRequest]) -> str | None:
    """The client field that needs the engine's tokenizer, if the rendered request uses one:
    a grammar needs the vocabulary, and bad words are tokenized by the engine."""
    params = gens[0].sampling_params
    if params.structured_outputs is not None:
        return constraint_field(client) or "tool_choice"
    return "bad_words" if params.bad_words else None


def constraint_field(client: ClientRequest) -> str | None:
    """The field a structured-output constraint came from, to name it when generate refuses
    the constraint (render cannot compile grammars: that needs the engine's backend)."""
    if _forces_tool_call(client):
        return "tool_choice"
    rf = client.response_format
    if rf and rf.get("type") != "text":
        return "response_format"
    if client.structured_outputs is not None:
        return "structured_outputs"
    return None


def _forces_tool_call(client: ClientRequest) -> bool:
    """A "required" or named tool choice: render's tool-call grammar replaces any other."""
    choice = getattr(client, "tool_choice", None)
    return bool(getattr(client, "tools", None)) and (
        choice == "required" or isinstance(choice, dict)
    )


def engine_id(gen: GenerateRequest) -> str:
    """The id vLLM gives the request (`generate-tokens-` + the X-Request-Id it was sent)."""
    return f"generate-tokens-{gen.request_id}"


def retry_id(gen: GenerateRequest) -> GenerateRequest:
    """The same request under a fresh engine id, for the one whole-request retry."""
    return msgspec.structs.replace(gen, request_id=f"{gen.request_id}-retry")


def public_id(gens: list[GenerateRequest]) -> str:
    """The response id the client sees (render's, as vLLM builds it): the request's, not one
    prompt's."""
    rid = str(gens[0].request_id)
    return rid.rsplit("-", 1)[0] if len(gens) > 1 else rid


@dataclass(frozen=True)
class Rendered:
    """render's generate requests under engine ids of the proxy's own, and the id the client
    sees. Engine ids never come from client input: two clients sending the same X-Request-Id
    must not share (or abort) each other's engine requests."""

    public_id: str
    gens: list[GenerateRequest]

    @classmethod
    def of(cls, gens: list[GenerateRequest], nonce: str) -> Rendered:
        """`nonce`: unique per client request (e.g. a random UUID's hex)."""
        own = [msgspec.structs.replace(g, request_id=f"tl-{nonce}-{p}") for p, g in enumerate(gens)]
        return cls(public_id(gens), own)


@dataclass(frozen=True)
class HopHeaders:
    """The client's headers that travel on: its request id (logs), vLLM's DP rank hint, and
    the W3C trace context (`traceparent`, `tracestate`): the client's as it came, or, while
    the proxy traces, the span of the hop that makes the call (`under`)."""

    request_id: str | None = None
    dp_rank: str | None = None
    trace: Mapping[str, str] = field(default_factory=dict)

    def under(self, trace: Mapping[str, str]) -> HopHeaders:
        """These headers with `trace` as the trace context (itself when `trace` is empty:
        tracing off leaves the client's as it came)."""
        return dataclasses.replace(self, trace=trace) if trace else self

    def pure(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.request_id:
            headers["X-Request-Id"] = self.request_id
        if self.trace:
            headers.update(self.trace)
        return headers

    def generate(self, gen: GenerateRequest) -> dict[str, str]:
        """The engine id is `generate-tokens-` + this X-Request-Id, so aborts can name it;
        vLLM continues the trace its `traceparent` names (when run with tracing flags)."""
        headers = {"Content-Type": "application/json", "X-Request-Id": str(gen.request_id)}
        if self.dp_rank:
            headers["X-data-parallel-rank"] = self.dp_rank
        if self.trace:
            headers.update(self.trace)
        return headers


def leg_of(gen: GenerateRequest) -> str:
    """Which run of a prompt an engine request is, by the suffix the proxy gave its id:
    `first`, `retry` (`retry_id`), `migration` (`proxy/flow/migration.py`'s `-m<N>`),
    `rerun` (decode-only after the first token diverged), `continuation` (after it) or
    `prompt` (`prompt_request`)."""
    tail = str(gen.request_id).rsplit("-", 1)[-1]
    if tail[:1] == "m" and tail[1:].isdigit():
        return "migration"
    return LEGS.get(tail, "first")


LEGS = {"retry": "retry", "whole": "rerun", "after": "continuation", "prompt": "prompt"}
