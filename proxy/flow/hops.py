"""The proxy's calls to render and generate, and the derender transport it was given.

`Hops` owns nothing: it uses the app's HTTP client and pools. It chooses each call's replica,
holds its lease and tells its pool the outcome (`flow/replicas.py`); the client layer makes the
call. Pure hops (render, derender) are retried on another replica through `on_replicas`; the
prefill leg tries each prefill replica and falls back to decode-only; a decode leg that fails
behind a prefill is run once more behind a fresh prefill (`behind_prefill`), as long as nothing
has reached the client.

While the request is traced (`shared/tracing.py`), each call here is a span, a child of the
request's, and names itself as the parent in the `traceparent` the call carries: render, each
prefill and decode leg (a stream's ends with it), never a chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenline.proxy.client.http import Client, HttpClientError, Limits
from tokenline.proxy.client.upstream import GENERATE_PATH, Pumping, post, readable
from tokenline.proxy.config import ProxyConfig
from tokenline.proxy.flow.derender import DerenderTransport
from tokenline.proxy.flow.replicas import (
    REPLICA,
    RetryPolicy,
    Tries,
    on_replicas,
    post_any,
    reported,
    stream_on,
    with_pool,
)
from tokenline.proxy.flow.requests import (
    HopHeaders,
    engine_id,
    engine_request,
    leg_of,
    prefill_request,
    retry_id,
)
from tokenline.proxy.metrics import ProxyMetrics
from tokenline.proxy.routing.cache_aware import Pick
from tokenline.proxy.routing.pool import Pool, Pools, Worker
from tokenline.shared import tracing
from tokenline.shared.errors import (
    ServiceError,
    UpstreamError,
    UpstreamFailed,
    UpstreamRejected,
    UpstreamUnavailable,
)
from tokenline.shared.kinds import Kind
from tokenline.shared.tracing import NO_SPAN, Attribute, Span
from tokenline.shared.wire import (
    GENERATE_RESPONSE,
    JSON,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    PromptLogprobs,
    Usage,
)

log = logging.getLogger(__name__)
HOP = "tokenline.hop"
T = TypeVar("T")
Decode = Callable[[GenerateRequest, "Prefilled", Sequence[Worker]], Awaitable[T]]
"""A decode leg: the request, its prefill leg's outcome, replicas to avoid."""
ABORT_GRACE = 1.0  # seconds pending aborts get at shutdown
ABORT_TIMEOUT = 5.0  # seconds one abort call may take


@dataclass(frozen=True)
class Prefilled:
    """Which prefill replica holds the prompt's KV, and how to pull it (None: decode-only)."""

    worker: Worker | None
    kv: dict[str, Any] | None
    prompt_logprobs: PromptLogprobs | None = None
    """Computed by the prefill leg when asked for: a decode behind it never runs the prompt."""
    first: GenerateChoice | None = None
    """The token the prefill leg sampled (a stream may show it first: `first_token.py`)."""


@dataclass(frozen=True)
class Timeouts:
    """Per hop; never a total limit, so a healthy long stream is never cut."""

    pure: Limits
    """render, derender and the prefill leg: connect, then the longest silence while an
    answer comes."""
    generate_whole: Limits
    generate_stream: Limits
    """connect, then the first byte, then at most this long between chunks."""

    @classmethod
    def of(cls, config: ProxyConfig) -> Timeouts:
        connect = config.connect_timeout
        return cls(
            pure=Limits(connect, config.hop_timeout),
            generate_whole=Limits(connect, config.first_token_timeout),
            generate_stream=Limits(connect, config.stream_idle_timeout),
        )


@dataclass
class Hops:
    client: Client
    pools: Pools
    policy: RetryPolicy
    metrics: ProxyMetrics
    derender: DerenderTransport
    timeouts: Timeouts
    prefill_first_token: bool = True
    """P/D streams show the prefill leg's token before the decode leg's (`first_token.py`)."""
    skip_prefill_within: int = 0
    """P/D: a prompt whose chosen decode replica is expected to hold all of it but at most
    this many tokens runs decode-only there (0: never)."""
    background: set[asyncio.Task[None]] = field(default_factory=set)
    reserved: dict[str, Pick] = field(default_factory=dict)
    """Decode replicas chosen before the prefill leg (which it then skipped), by engine id."""
    aborting: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def render(self, kind: Kind, raw: bytes, headers: HopHeaders) -> list[GenerateRequest]:
        with tracing.current().hop("render", {HOP: "render"}) as span:
            call = post_any(
                self.client,
                self.pools.render,
                self.policy,
                kind.render_path,
                raw,
                headers.under(span.headers()).pure(),
                self.timeouts.pure,
                kind.generate_requests,  # an answer render's replica garbled goes to another
                span,
            )
            gens = await self.metrics.timed("render", call)
            span.set("tokenline.prompts", len(gens))
            return gens

    async def prefill(
        self,
        gen: GenerateRequest,
        kind: Kind,
        headers: HopHeaders,
        exclude: Sequence[Worker] = (),
    ) -> Prefilled:
        """The P/D prefill leg: the prompt's KV computed on a prefill instance, and the
        `kv_transfer_params` the decode instance needs to pull it.

        Failing prefill replicas are marked down and others tried; with none left the request
        goes decode-only (the decode instance computes the prompt itself), which the client
        never notices. A 4xx is the request's fault and goes back to the client.
        """
        pool = self.pools.prefill
        if not pool.configured:
            return Prefilled(None, None)
        body = JSON.encode(prefill_request(engine_request(gen, kind, False, None)))
        pick = _routed_pick(pool, gen, exclude)
        with tracing.current().hop("prefill", _leg("prefill", gen, pick)) as span:
            hdrs = headers.under(span.headers())
            return await self._prefill(gen, hdrs, exclude, body, pick, span)

    async def _prefill(
        self,
        gen: GenerateRequest,
        headers: HopHeaders,
        exclude: Sequence[Worker],
        body: bytes,
        pick: Pick | None,
        span: Span,
    ) -> Prefilled:
        pool = self.pools.prefill
        tries = Tries(span)

        async def once(worker: Worker) -> Prefilled:
            tries.start(worker)
            uncached = pick.uncached if pick is not None and worker is pick.worker else 0
            with (
                self.metrics.prompt_in_flight(pool.role, worker.url, len(gen.token_ids)),
                pool.lease(worker, uncached),
            ):
                data = await post(
                    self.client,
                    pool.role,
                    worker.url,
                    GENERATE_PATH,
                    body,
                    with_pool(pool, headers.generate(gen)),
                    self.timeouts.pure,
                )
            answer = readable(pool.role, GENERATE_RESPONSE.decode, data)
            _usage(span, answer.usage)
            if answer.kv_transfer_params is None:
                raise UpstreamError(
                    f"prefill {worker.url} returned no kv_transfer_params "
                    "(is it started with --role prefill?)"
                )
            first = answer.choices[0] if answer.choices else None
            return Prefilled(worker, answer.kv_transfer_params, answer.prompt_logprobs, first)

        every = RetryPolicy(attempts=len(pool.workers), timeout=self.policy.timeout, sleep=False)
        try:
            chosen = pick.worker if pick is not None else None
            call = on_replicas(pool, every, once, exclude, chosen=chosen)
            return await self.metrics.timed("prefill", call)
        except ServiceError as exc:
            if _own_fault(exc):
                raise  # the request's own fault: decode-only would refuse it too
            self.metrics.prefill_fallbacks.inc()
            span.set("tokenline.prefill_fallback", True)
            log.warning(
                "prefill.fallback request_id=%s: no prefill replica left, decode-only",
                gen.request_id,
            )
            return Prefilled(None, None)

    async def generate_whole(
        self, gen: GenerateRequest, headers: HopHeaders, exclude: Sequence[Worker] = ()
    ) -> GenerateResponse:
        pool = self.pools.decode
        pick = self._decode_pick(pool, gen, exclude)
        with tracing.current().hop("decode", _leg("decode", gen, pick)) as span:
            return await self._generate_whole(gen, headers.under(span.headers()), pick, span)

    async def _generate_whole(
        self, gen: GenerateRequest, headers: HopHeaders, pick: Pick, span: Span
    ) -> GenerateResponse:
        pool, worker = self.pools.decode, pick.worker
        body = JSON.encode(gen)
        hdrs, timeout = with_pool(pool, headers.generate(gen)), self.timeouts.generate_whole
        call = post(self.client, pool.role, worker.url, GENERATE_PATH, body, hdrs, timeout)
        try:
            with reported(pool, worker):  # an unreadable answer counts against the replica
                with pool.lease(worker, pick.uncached):
                    data = await self.metrics.timed("decode", call)
                answer = readable(pool.role, GENERATE_RESPONSE.decode, data)
        except ServiceError as exc:
            if not _own_fault(exc):
                self.abort(worker, gen)  # it may still be running (e.g. a timeout)
            raise
        _usage(span, answer.usage)
        return answer

    def generate_stream(
        self, gen: GenerateRequest, headers: HopHeaders, exclude: Sequence[Worker] = ()
    ) -> tuple[Worker, AsyncGenerator[list[bytes], Pumping | None]]:
        """A decode replica and the SSE payloads of `gen` streamed on it (those of one read
        together)."""
        pool = self.pools.decode
        pick = self._decode_pick(pool, gen, exclude)
        span = tracing.current().start("decode", _leg("decode", gen, pick))
        body = JSON.encode(gen)
        hdrs, limits = headers.under(span.headers()).generate(gen), self.timeouts.generate_stream
        source = stream_on(self.client, pool, pick.worker, body, hdrs, limits, pick.uncached, span)
        return pick.worker, source

    def _decode_pick(self, pool: Pool, gen: GenerateRequest, exclude: Sequence[Worker]) -> Pick:
        """The decode replica for `gen`: the one reserved when its prefill leg was skipped,
        else the pool's choice (by cached prefix, where the pool routes so)."""
        reserved = self.reserved.pop(engine_id(gen), None)
        if reserved is not None and reserved.worker.healthy and reserved.worker not in exclude:
            return reserved
        return pool.pick(exclude, pool.prompt(gen))

    def _reserve_decode(self, gen: GenerateRequest) -> bool:
        """P/D with a cache-aware decode pool: `gen`'s decode replica, chosen now (by what it
        holds and its load) and reserved for its decode leg. True when that replica holds all
        of the prompt but at most `skip_prefill_within` tokens: the prefill leg is skipped
        (counted) and the prompt runs decode-only there."""
        pool = self.pools.decode
        pick = _routed_pick(pool, gen, ()) if self.pools.prefill.configured else None
        if pick is None:
            return False
        self.reserved[engine_id(gen)] = pick
        within = self.skip_prefill_within
        if not within or not pick.cached_blocks or pick.uncached > within:
            return False
        self.metrics.prefill_skipped.inc()
        return True

    async def behind_prefill(
        self,
        gen: GenerateRequest,
        kind: Kind,
        headers: HopHeaders,
        decode: Decode[T],
        may_retry: Callable[[], bool] = lambda: True,
    ) -> T:
        """`decode(gen, prefilled, exclude)` behind a prefill leg, run once more where that is safe.

        Once more only while nothing reached the client (`may_retry()`), only after the first
        run's abort went out (never two engine runs of one request at once), and only when
        another run can do better: a decode leg that failed behind a prefill (e.g. that replica
        died before the KV was pulled) reruns behind a fresh prefill elsewhere (or decode-only);
        a decode replica that failed by its own fault (unreachable, hung, broken) is replaced
        by another healthy one.
        """
        skip = self._reserve_decode(gen)
        if skip:
            tracing.current().note("tokenline.prefill_skipped", True)
        pre = Prefilled(None, None) if skip else await self.prefill(gen, kind, headers)
        try:
            return await decode(gen, pre, ())
        except ServiceError as exc:
            failed = exc.replica if isinstance(exc.replica, Worker) else None
            if not may_retry() or not self._worth_rerun(exc, pre, failed):
                raise
            await self.aborted(gen)
            exclude = [failed] if failed is not None else []
        finally:
            self.reserved.pop(engine_id(gen), None)
        self.metrics.retries.inc()
        tracing.current().note("tokenline.retries", 1)
        gen = retry_id(gen)
        pre = await self.prefill(gen, kind, headers, exclude=[pre.worker] if pre.worker else [])
        return await decode(gen, pre, exclude)

    def _worth_rerun(self, exc: ServiceError, pre: Prefilled, failed: Worker | None) -> bool:
        if _own_fault(exc):
            return False
        if pre.worker is not None:
            return True
        if isinstance(exc, UpstreamFailed) or failed is None:
            return False  # the engine failed the request itself: another run would too
        return any(w is not failed for w in self.pools.decode.healthy())

    def abort(self, worker: Worker, gen: GenerateRequest) -> None:
        """Tell the engine to drop `gen` now (closing its stream also does, later)."""
        rid = engine_id(gen)
        task = asyncio.create_task(self._abort(worker, rid))
        self.background.add(task)
        self.aborting[rid] = task
        task.add_done_callback(self.background.discard)
        task.add_done_callback(lambda _: self.aborting.pop(rid, None))

    async def aborted(self, gen: GenerateRequest) -> None:
        """Wait (a bounded moment) for the abort of `gen`'s engine run to go out."""
        task = self.aborting.get(engine_id(gen))
        if task is not None:
            await asyncio.wait([task], timeout=ABORT_GRACE)

    async def _abort(self, worker: Worker, engine_request_id: str) -> None:
        body = JSON.encode({"request_ids": [engine_request_id]})
        # both generate pools carry the same key (`Pool.headers`)
        headers = {"Content-Type": "application/json", **self.pools.decode.headers}
        url = worker.url + "/inference/v1/abort_requests"
        with contextlib.suppress(HttpClientError, TimeoutError, OSError):
            async with asyncio.timeout(ABORT_TIMEOUT):
                await self.client.fetch("POST", url, body, headers)

    async def settle(self) -> None:
        """Give pending aborts a moment to go out (at shutdown)."""
        if self.background:
            await asyncio.wait(list(self.background), timeout=ABORT_GRACE)


def _leg(role: str, gen: GenerateRequest, pick: Pick | None) -> dict[str, Attribute]:
    """A generate leg's span attributes: the engine's request id (vLLM's own span names it
    `gen_ai.request.id`), which run of the prompt it is, its prompt, and, when routing chose
    the replica by cached prefix, the tokens it was expected to hold."""
    traces = tracing.current()
    if not traces.on:
        return {}
    leg = leg_of(gen)
    attributes: dict[str, Attribute] = {
        HOP: role,
        "gen_ai.request.id": engine_id(gen),
        "tokenline.leg": leg,
        "gen_ai.usage.prompt_tokens": len(gen.token_ids),
    }
    if pick is not None:
        attributes[REPLICA] = pick.worker.url
        if pick.cached_blocks:
            attributes["tokenline.expected_cached_tokens"] = len(gen.token_ids) - pick.uncached
    if leg == "migration":
        traces.note("tokenline.migrations", int(str(gen.request_id).rsplit("-m", 1)[1]))
    return attributes


def _usage(span: Span, usage: Usage | None) -> None:
    """A generate answer's token counts on its hop's span (cached: what the engine found in
    its prefix cache, when it reports prompt token details)."""
    if usage is None or span is NO_SPAN:
        return
    span.set("gen_ai.usage.prompt_tokens", usage.prompt_tokens)
    if usage.completion_tokens is not None:
        span.set("gen_ai.usage.completion_tokens", usage.completion_tokens)
    details = usage.prompt_tokens_details
    if isinstance(details, dict) and isinstance(cached := details.get("cached_tokens"), int):
        span.set("tokenline.cached_tokens", cached)


def _routed_pick(pool: Pool, gen: GenerateRequest, exclude: Sequence[Worker]) -> Pick | None:
    """A cache-aware pool's replica for `gen`, chosen ahead of the call (None: the pool does
    not route by prefix, or has no healthy replica now: the call's own choice, and its
    failure, stay as they were)."""
    prompt = pool.prompt(gen)
    if prompt is None:
        return None
    try:
        return pool.pick(exclude, prompt)
    except UpstreamUnavailable:
        return None


def _own_fault(exc: ServiceError) -> bool:
    """A 4xx: the request's own fault, which no other replica or leg would serve either."""
    return isinstance(exc, UpstreamRejected) and not isinstance(exc, UpstreamFailed)
