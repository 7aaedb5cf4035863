"""One client request through the hops: whole answers, and streams as chunk structs.

Nothing here knows HTTP: `Streaming` hands the chunks a client should see to its `out` (and
raises `ServiceError` when the stream fails) and the route frames them
(proxy/api/completions.py). Each prompt of a request decodes in its own task, which reads its
generate stream, derenders through the app's transport and writes to the client: no queue and no
other task per chunk. Leaving early (client gone, stop string) closes the decode stream and
aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from tokenline.proxy.client.upstream import Pumping
from tokenline.proxy.flow.chunks import (
    ReadChoice,
    StreamFlow,
    generate_chunk,
    merge_chunks,
    whole_derender_body,
)
from tokenline.proxy.flow.first_token import FirstToken, for_legs
from tokenline.proxy.flow.hops import Hops, Prefilled
from tokenline.proxy.flow.migration import MAX_MIGRATIONS, continuation, why_not
from tokenline.proxy.flow.pump import Pump
from tokenline.proxy.flow.requests import (
    ClientChunk,
    ClientRequest,
    HopHeaders,
    Rendered,
    engine_request,
    prompt_request,
)
from tokenline.proxy.routing.pool import Worker
from tokenline.shared.errors import (
    Diverged,
    ServiceError,
    UpstreamError,
    UpstreamRejected,
    as_service_error,
)
from tokenline.shared.kinds import Kind
from tokenline.shared.wire import (
    JSON,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChunk,
    PromptLogprobs,
)

log = logging.getLogger(__name__)
Outgoing = ClientChunk | msgspec.Raw | dict[str, Any]


async def whole(
    hops: Hops,
    kind: Kind,
    client: ClientRequest,
    raw: bytes,
    rendered: Rendered,
    headers: HopHeaders,
) -> Any:
    """The non-streaming answer: every prompt generated, then derendered in one call."""
    gens = rendered.gens

    async def decode(
        gen: GenerateRequest, pre: Prefilled, exclude: Sequence[Worker]
    ) -> GenerateResponse:
        answer = await hops.generate_whole(
            engine_request(gen, kind, False, pre.kv), headers, exclude
        )
        if pre.prompt_logprobs is None:
            return answer
        return msgspec.structs.replace(answer, prompt_logprobs=pre.prompt_logprobs)

    legs = (hops.behind_prefill(g, kind, headers, decode) for g in gens)
    responses = await asyncio.gather(*legs)
    body = whole_derender_body(kind, client, raw, gens, list(responses))
    answer = await hops.derender.whole(kind, JSON.encode(body), headers.pure())
    return msgspec.structs.replace(answer, id=rendered.public_id)


class Out(Protocol):
    """Where a stream's chunks go: the client (one write per call)."""

    async def send(self, chunks: list[Outgoing]) -> None: ...

    def open(self) -> bool:
        """`send_now` may write: the response started, and the client's buffer has room."""
        ...

    def send_now(self, chunks: list[Outgoing]) -> bool:
        """`send` without waiting (only when `open()`); False: the buffer is full now."""
        ...


@dataclass
class Streaming:
    """One streaming client request: every prompt's decode stream, derendered."""

    hops: Hops
    flow: StreamFlow
    headers: HopHeaders
    out: Out
    started: float = field(default_factory=time.perf_counter)
    last_sent: float | None = None
    first_shown: dict[int, int] = field(default_factory=dict)
    """Per prompt: the prefill leg's token, shown before its decode stream (`first_token.py`);
    every decode stream of that prompt must begin with it, and drops it."""

    async def run(self) -> None:
        """Every prompt's chunks to `out` as derender answers them, then the usage chunk if
        asked for; raises the first failure (the other prompts are cancelled, which aborts
        their engine runs, as does cancelling this)."""
        failure: Exception | None = None
        try:
            async with asyncio.TaskGroup() as group:
                for p, gen in enumerate(self.flow.gens):
                    group.create_task(self._prompt(p, gen))
        except* Exception as eg:
            # the first failure stands for the request (a bug is logged and becomes a 500);
            # raised after the block: Python 3.11.0-3.11.3 wrap what an except* clause raises
            # in a new group
            failure = eg.exceptions[0]
        if failure is not None:
            raise as_service_error(failure) from None
        if (final := self.flow.final_chunk()) is not None:
            await self.out.send([final])

    async def _prompt(self, p: int, gen: GenerateRequest) -> None:
        async def decode(g: GenerateRequest, pre: Prefilled, exclude: Sequence[Worker]) -> None:
            if self.flow.needs_prompt_logprobs():
                self.flow.prompt_logprobs[p] = await self._prompt_logprobs(g, pre, exclude)
            first = self._first_token(p, g, pre)
            try:
                await self._decode(p, g, pre.kv, exclude, first)
            except Diverged as exc:
                await self._after_divergence(p, gen, g, exc)

        legs = for_legs(gen) if self._shows_prefill_token() else gen
        try:
            await self.hops.behind_prefill(
                legs, self.flow.kind, self.headers, decode, may_retry=lambda: self._unseen(p)
            )
        except ServiceError as exc:
            await self._migrate(p, gen, exc)

    async def _after_divergence(
        self, p: int, gen: GenerateRequest, leg: GenerateRequest, exc: Diverged
    ) -> None:
        """Prompt `p`'s decode leg began with another token than the one shown (a near-tie
        the decode engine, computing the last prompt position from pulled KV, resolved the
        other way): rerun decode-only, which computes the prompt in one pass as the prefill
        engine and monolithic vLLM do. Should that diverge too (the engines disagree even
        so), the stream goes on from the token shown, where it can continue exactly
        (`proxy/flow/migration.py`; `gen` is the client's, without the seed drawn for the legs);
        otherwise it fails as before."""
        self._diverged(leg, exc)
        await self.hops.aborted(leg)
        again = msgspec.structs.replace(leg, request_id=f"{leg.request_id}-whole")
        try:
            await self._decode(p, again, None, (), FirstToken(self.first_shown[p]))
        except Diverged as twice:
            if why_not(gen) is not None:
                raise
            self._diverged(again, twice)
            await self.hops.aborted(again)
            more = continuation(gen, self.flow.generated(p), 1)
            more = msgspec.structs.replace(more, request_id=f"{gen.request_id}-after")
            await self._decode(p, more, None, ())

    def _diverged(self, leg: GenerateRequest, exc: Diverged) -> None:
        log.warning("stream.first_token request_id=%s: %s", leg.request_id, exc.message)
        self.hops.metrics.first_tokens.labels("diverged").inc()

    def _shows_prefill_token(self) -> bool:
        return self.hops.prefill_first_token and self.hops.pools.prefill.configured

    def _first_token(self, p: int, gen: GenerateRequest, pre: Prefilled) -> FirstToken | None:
        """The token prompt `p`'s decode stream must begin with, shown already or to be shown
        now (None: the stream shows its own first token)."""
        shown = self.first_shown.get(p)
        if shown is not None:
            return FirstToken(shown)
        if not self._shows_prefill_token() or self.flow.emitted(p):
            return None
        return FirstToken.of(gen, pre.first, pre.kv)

    def _unseen(self, p: int) -> bool:
        """Nothing of prompt `p` reached the client but (maybe) the prefill leg's token, which
        a rerun's decode stream begins with and drops: a rerun is invisible."""
        shown = self.first_shown.get(p)
        return not self.flow.emitted(p) or self.flow.generated(p) == [shown]

    async def _migrate(self, p: int, gen: GenerateRequest, exc: ServiceError) -> None:
        """Continue prompt `p` on another decode replica after its own failed mid-stream
        (`proxy/flow/migration.py`), at most `MAX_MIGRATIONS` times; otherwise re-raise `exc`."""
        tried: list[Worker] = []
        for attempt in range(1, MAX_MIGRATIONS + 1):
            failed = exc.replica
            if not self._may_migrate(p, gen, exc) or not isinstance(failed, Worker):
                raise exc
            tried.append(failed)
            log.warning(
                "stream.migrate request_id=%s from=%s after=%d tokens: %s",
                gen.request_id, failed.url, len(self.flow.generated(p)), exc.message,
            )  # fmt: skip
            self.hops.metrics.migrations.inc()
            more = continuation(gen, self.flow.generated(p), attempt)
            try:
                await self._decode(p, more, None, tried)
                return
            except ServiceError as again:
                exc, gen = again, more
        raise exc

    def _may_migrate(self, p: int, gen: GenerateRequest, exc: ServiceError) -> bool:
        """A decode replica's fault (not the request's, not another hop's), after output went
        out (before it, `behind_prefill` already ran the request once more), for a request
        that continues exactly, with a healthy replica left."""
        decode = self.hops.pools.decode
        return (
            self.flow.emitted(p)
            and not self.flow.prompt_done(p)
            and not isinstance(exc, UpstreamRejected)
            and exc.replica in decode.workers
            and why_not(gen) is None
            and any(w is not exc.replica for w in decode.healthy())
        )

    async def _prompt_logprobs(
        self, gen: GenerateRequest, pre: Prefilled, exclude: Sequence[Worker]
    ) -> PromptLogprobs:
        """The prompt logprobs an echo shows first: the prefill leg's, else a prompt leg's
        (one more prefill on a decode replica before the stream, only for such requests)."""
        if pre.prompt_logprobs is not None:
            return pre.prompt_logprobs
        answer = await self.hops.generate_whole(prompt_request(gen), self.headers, exclude)
        if answer.prompt_logprobs is None:
            raise UpstreamError("generate answered the prompt leg without prompt_logprobs")
        return answer.prompt_logprobs

    async def _decode(
        self,
        p: int,
        gen: GenerateRequest,
        kv: dict[str, Any] | None,
        exclude: Sequence[Worker],
        first: FirstToken | None = None,
    ) -> None:
        """Prompt `p`'s generate stream, read in the task that derenders it: what arrives while
        derender answers waits in the socket's buffer and comes in the next read, merged per
        choice (and an engine that gets ahead of a slow client is held back by TCP). With
        `first`, the stream begins with that token, shown to the client while the engine
        starts (unless shown already)."""
        flow, hops = self.flow, self.hops
        worker, source = hops.generate_stream(
            engine_request(gen, flow.kind, True, kv), self.headers, exclude
        )
        finished = False
        try:
            await self._read(p, source, gen, first)
            finished = True
        except ServiceError:
            if not flow.prompt_done(p) or flow.stopped_early(p):
                raise
            finished = True  # it failed after its last chunk: the client misses nothing
        finally:
            if not finished or flow.stopped_early(p):
                # left early, failed (it may still run: hung), or ended by a stop string
                hops.metrics.aborts.labels("stop" if finished else "cancelled").inc()
                hops.abort(worker, gen)

    async def _read(
        self,
        p: int,
        source: AsyncGenerator[list[bytes], Pumping | None],
        gen: GenerateRequest,
        first: FirstToken | None,
    ) -> None:
        """Prompt `p`'s generate stream to its end (or to a stop string), each read's chunks
        derendered and written to the client (`first` shown while the stream starts, unless
        shown already, then dropped from it)."""
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(contextlib.aclosing(source))
            if first is not None and p not in self.first_shown:
                # None: the shown token ended the choice (a stop string): `_decode` aborts
                payloads = await self._show_first(p, gen, first, source)
            else:
                payloads = await anext(source, None)
            if payloads is not None:  # from its first chunk on, batches wait for this stream
                stack.enter_context(self.hops.derender.streaming())
            while payloads is not None:
                first = await self._take(p, payloads, first)
                if self.flow.stopped_early(p) and self.flow.prompt_done(p):
                    break  # the engine is still generating: `_decode` aborts it
                if first is None and self._pumpable(p):
                    payloads = await self._pumped(p, source)
                else:
                    payloads = await anext(source, None)
            # a finished stream is read to its end: its connection is then reused

    def _pumpable(self, p: int) -> bool:
        """Prompt `p` may go on in callbacks (`proxy/flow/pump.py`): one choice, not over, and a
        client that can take a write at once."""
        return self.flow.n == 1 and not self.flow.prompt_done(p) and self.out.open()

    async def _pumped(
        self, p: int, source: AsyncGenerator[list[bytes], Pumping | None]
    ) -> list[bytes] | None:
        """Prompt `p` pumped until the pump gives it back: then its next read (what the pump
        gave back, maybe nothing), the call in flight answered and written first."""
        pump = Pump(self, p)
        try:
            try:
                payloads = await source.asend(pump)
            except StopAsyncIteration:
                payloads = None
            except ServiceError:
                # the engine failed under a call in flight: it is answered first, as it was
                # made (the client sees what it would have), then the failure stands
                with contextlib.suppress(ServiceError):
                    await pump.settled()
                raise
            await pump.settled()
            return payloads
        finally:
            pump.close()

    async def _take(
        self, p: int, payloads: list[bytes], first: FirstToken | None
    ) -> FirstToken | None:
        """One read's chunks derendered and written to the client; `first` dropped from them
        (None once it has been)."""
        chunks = merge_chunks([generate_chunk(x) for x in payloads])
        if first is not None:
            chunks, waiting = first.dropped_from(chunks)
            if not waiting:
                self.hops.metrics.first_tokens.labels("same").inc()
                first = None
        ready = []
        for chunk in chunks:
            ready += await self._relay(p, chunk)
        if ready:
            await self.out.send(ready)
        return first

    async def _show_first(
        self,
        p: int,
        gen: GenerateRequest,
        first: FirstToken,
        source: AsyncGenerator[list[bytes], Pumping | None],
    ) -> list[bytes] | None:
        """`first` derendered and written to the client while the decode stream starts; the
        stream's first read (None: the shown token ended the choice, or the stream was empty)."""
        reading = asyncio.create_task(_next(source))
        try:
            answer = await self._relay(p, first.chunk(gen), urgent=True)
            self.first_shown[p] = first.token  # with the state derender just gave
            if answer:
                await self.out.send(answer)
        except BaseException:
            await _settled(reading)
            raise
        if self.flow.stopped_early(p) and self.flow.prompt_done(p):
            await _settled(reading)  # the decode leg is not needed
            return None
        return await reading

    async def _relay(
        self, p: int, chunk: GenerateStreamChunk, urgent: bool = False
    ) -> list[Outgoing]:
        call = self.flow.call(p, chunk, urgent)
        if call is None:
            return []
        return self.accepted(p, chunk.choices[0], await self.hops.derender.stream(call))

    def accepted(self, p: int, choice: ReadChoice, answer: Any) -> list[Outgoing]:
        """Derender's answer for a chunk of prompt `p` with `choice`: what the client gets (a
        chunk, a chat stream's opening chunks before its first, or nothing)."""
        emission = self.flow.accept(p, choice, answer)
        if emission is None:
            return []
        now = time.perf_counter()
        if self.last_sent is None:
            self.hops.metrics.ttft.observe(now - self.started)
        elif emission.tokens:
            self.hops.metrics.itl.observe((now - self.last_sent) / emission.tokens)
        self.last_sent = now
        return emission.chunks()


async def _next(source: AsyncGenerator[list[bytes], Pumping | None]) -> list[bytes] | None:
    return await anext(source, None)


async def _settled(task: asyncio.Task[Any]) -> None:
    """`task` over, its outcome dropped: cancelled if still running."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
