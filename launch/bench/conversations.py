"""The load of `tokenline bench routing`: seeded sessions of growing chat requests (a
conversation's turns, an agent's steps, one-shot requests behind one prefix, conversations on
LoRA adapters) and a driver that sends them as clients would: each request after the last
one's answer and a pause, the answer appended to the next one's history, a bounded number in
flight.

Answers are the model's own (greedy, a fixed length), so a request's history holds the tokens
the engine that served the turn before may still cache.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from tokenline.launch.bench.sse import SseError, aiter_payloads
from tokenline.launch.models.corpus import WORDS

Message = dict[str, Any]
DOCUMENT_WORDS = 900
"""The agents' shared tool result: ~1.1k tokens on the tiny models' tokenizer, so that an
agent's fifth step (its history holding four answers of the model's, which retokenize longer)
stays inside a 2,048-token context."""

# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Session:
    """One client's requests, in order. Request k sends `opening`, then each earlier ask with
    the answer it got, then ask k; the client first waits `pauses[k]` seconds (a user
    reading and typing, an agent running its tool)."""

    name: str
    opening: tuple[Message, ...]
    asks: tuple[str, ...]
    pauses: tuple[float, ...]
    model: str = "tiny"
    """The served model or LoRA adapter every request of the session names."""

    def messages(self, k: int, answers: Sequence[str]) -> list[Message]:
        out = list(self.opening)
        for ask, answer in zip(self.asks[:k], answers[:k], strict=True):
            out += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        return [*out, {"role": "user", "content": self.asks[k]}]


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    max_tokens: int
    concurrency: int
    """Requests in flight at most (sessions past it wait for a slot)."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters its engines must serve (`Session.model` names them)."""

    @property
    def requests(self) -> int:
        return sum(len(s.asks) for s in self.sessions)


def sentences(rng: random.Random, words: int) -> str:
    """About `words` words of seeded English sentences (about a token a word on the tiny
    models' tokenizer)."""
    out: list[str] = []
    left = words
    while left > 0:
        n = min(left, rng.randint(6, 14))
        out.append(" ".join(rng.choices(WORDS, k=n)).capitalize() + ".")
        left -= n
    return " ".join(out)


def chat(seed: int, conversations: int = 8, turns: int = 5) -> Workload:
    """Conversations behind one system prompt; each turn appends the answer and a new user
    message after a pause."""
    rng = random.Random(f"chat-{seed}")
    system = {"role": "system", "content": "You are a helpful assistant. " + sentences(rng, 250)}
    sessions = tuple(
        Session(
            f"conversation-{i}",
            (system,),
            tuple(sentences(rng, rng.randint(15, 40)) + "?" for _ in range(turns)),
            (rng.uniform(0.0, 0.5), *(rng.uniform(0.5, 2.0) for _ in range(turns - 1))),
        )
        for i in range(conversations)
    )
    return Workload("chat", sessions, max_tokens=48, concurrency=conversations)


def agent(seed: int, agents: int = 4, steps: int = 5) -> Workload:
    """Agents behind one long tool result (a shared document), each asking its own short
    follow-ups over its own history."""
    rng = random.Random(f"agent-{seed}")
    call = {"name": "read_report", "arguments": json.dumps({"id": f"IR-{seed}"})}
    opening: tuple[Message, ...] = (
        {"role": "system", "content": "You are an incident analyst. " + sentences(rng, 60)},
        {"role": "user", "content": "Read the incident report, then answer the team."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call-0", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call-0", "content": sentences(rng, DOCUMENT_WORDS)},
    )
    sessions = tuple(
        Session(
            f"agent-{i}",
            opening,
            tuple(sentences(rng, rng.randint(8, 20)) + "?" for _ in range(steps)),
            tuple(rng.uniform(0.1, 0.5) for _ in range(steps)),
        )
        for i in range(agents)
    )
    return Workload("agent", sessions, max_tokens=32, concurrency=agents)


def hot(seed: int, requests: int = 64, concurrency: int = 16) -> Workload:
    """Many one-shot requests behind one long prefix, `concurrency` at a time."""
    rng = random.Random(f"hot-{seed}")
    prefix = ({"role": "system", "content": "Answer from this manual. " + sentences(rng, 1000)},)
    sessions = tuple(
        Session(f"request-{i}", prefix, (sentences(rng, rng.randint(10, 20)) + "?",), (0.0,))
        for i in range(requests)
    )
    return Workload("hot", sessions, max_tokens=16, concurrency=concurrency)


ADAPTERS = ("a1", "a2", "a3")


def adapters(seed: int, conversations: int = 16, turns: int = 3) -> Workload:
    """Conversations spread over three LoRA adapters and the base model in turn, each with a
    system prompt of its own (an adapter's blocks are its own: vLLM keys them by adapter),
    8 at a time."""
    rng = random.Random(f"adapters-{seed}")
    models = ("tiny", *ADAPTERS)
    systems = {
        m: {"role": "system", "content": f"You are assistant {m}. " + sentences(rng, 150)}
        for m in models
    }
    sessions = tuple(
        Session(
            f"conversation-{i}",
            (systems[models[i % len(models)]],),
            tuple(sentences(rng, rng.randint(15, 40)) + "?" for _ in range(turns)),
            (rng.uniform(0.0, 0.5), *(rng.uniform(0.2, 1.0) for _ in range(turns - 1))),
            model=models[i % len(models)],
        )
        for i in range(conversations)
    )
    return Workload("adapters", sessions, max_tokens=32, concurrency=8, adapters=ADAPTERS)


WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "chat": chat,
    "agent": agent,
    "hot": hot,
    "adapters": adapters,
}

# --------------------------------------------------------------------------- driving


@dataclass(frozen=True)
class Reply:
    ttft: float
    e2e: float
    tokens: int
    text: str
    error: str | None = None


def failed(error: str) -> Reply:
    return Reply(0.0, 0.0, 0, "", error)


def body(messages: list[Message], max_tokens: int, model: str = "tiny") -> dict[str, Any]:
    """A streamed greedy chat request of exactly `max_tokens` tokens."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def ask(http: aiohttp.ClientSession, url: str, request: dict[str, Any]) -> Reply:
    """One streamed chat request: its answer's text, token count, TTFT (first content) and
    end-to-end time."""
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage = None
    try:
        async with http.post(url + "/v1/chat/completions", json=request) as resp:
            if resp.status != 200:
                return failed(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for payload in aiter_payloads(resp):
                chunk = json.loads(payload)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if piece := (choice.get("delta") or {}).get("content"):
                        first = first or time.perf_counter()
                        parts.append(piece)
    except (aiohttp.ClientError, TimeoutError, SseError) as exc:
        return failed(repr(exc))
    end = time.perf_counter()
    if usage is None:
        return failed("the stream carried no usage")
    return Reply((first or end) - start, end - start, usage["completion_tokens"], "".join(parts))


async def run_session(
    http: aiohttp.ClientSession,
    url: str,
    session: Session,
    max_tokens: int,
    slots: asyncio.Semaphore,
) -> list[Reply]:
    """A session's requests in turn, each after its pause; stops at the first failure (the
    next turn would need its answer)."""
    answers: list[str] = []
    replies: list[Reply] = []
    for k, pause in enumerate(session.pauses):
        await asyncio.sleep(pause)
        async with slots:
            request = body(session.messages(k, answers), max_tokens, session.model)
            reply = await ask(http, url, request)
        replies.append(reply)
        if reply.error is not None:
            break
        answers.append(reply.text)
    return replies


async def drive(url: str, workload: Workload) -> tuple[list[Reply], float]:
    """Every session of `workload` at once through `url`; the replies and the wall time."""
    slots = asyncio.Semaphore(workload.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        start = time.perf_counter()
        done = await asyncio.gather(
            *(run_session(http, url, s, workload.max_tokens, slots) for s in workload.sessions)
        )
        seconds = time.perf_counter() - start
    return [r for replies in done for r in replies], seconds
