"""Does each bench target answer what monolithic vLLM answers? A few greedy requests with top-2
logprobs, chat and completions, whole and streamed, with and without a stop string, compared
field by field with monolithic `vllm serve` in the same run: text, every logprob entry (token,
logprob, top candidates), finish and stop reason, completion tokens.

Logprobs compare at float32, the engine's own precision: vLLM prints float64 expansions of the
float32 values, the gateway their shortest float32 form, both the same number. The engine alone
answers token IDs, so it is compared on what it has: token IDs and logprob values.

Parsing and comparing are pure (tested without servers); `ask` does the HTTP.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp

from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS

Token = str | int


def f32(x: float) -> float:
    """`x` rounded to float32, the precision the engine computes logprobs in."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


@dataclass(frozen=True)
class Entry:
    """One sampled token's logprob entry: the token (text, or ID from the engine alone), its
    logprob, and the top candidates in the order given."""

    token: Token
    logprob: float
    top: tuple[tuple[Token, float], ...] = ()


@dataclass(frozen=True)
class Answer:
    """One answer, streamed or whole, reduced to what is compared. None: the answer lacks it."""

    text: str | None = None
    entries: tuple[Entry, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # chat | completion
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def cases(max_tokens: int = 24) -> list[Case]:
    """The greedy requests, without stop strings (`with_stops` adds those from vLLM's texts)."""
    common = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0}
    chat = {**common, "messages": [{"role": "user", "content": TEXTS[8]}]}
    chat |= {"logprobs": True, "top_logprobs": 2}
    completion = {**common, "prompt": TEXTS[3], "logprobs": 2}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    return [
        Case("chat, streamed", "chat", {**chat, **streamed}),
        Case("chat, whole", "chat", chat),
        Case("completion, streamed", "completion", {**completion, **streamed}),
        Case("completion, whole", "completion", completion),
    ]


def stop_string(text: str) -> str | None:
    """Two whole characters from the middle of `text`, neither a replacement character nor
    space, so the stop fires part way through the answer; None if there are none."""
    for i in range(max(1, len(text) // 3), len(text) - 1):
        pair = text[i : i + 2]
        if "\ufffd" not in pair and not any(c.isspace() for c in pair):
            return pair
    return None


def with_stops(base: list[Case], reference: dict[str, Answer]) -> list[Case]:
    """For each streamed case, a copy with a stop string taken from vLLM's answer to it."""
    out = []
    for case in base:
        text = reference.get(case.name, Answer()).text
        stop = stop_string(text) if case.stream and text else None
        if stop is not None:
            out.append(Case(f"{case.name}, stop string", case.kind, {**case.body, "stop": [stop]}))
    return out


# --------------------------------------------------------------------------- parsing


def _chat_entries(logprobs: dict[str, Any] | None) -> list[Entry] | None:
    if not logprobs or logprobs.get("content") is None:
        return None
    return [
        Entry(
            e.get("token", e.get("token_id")),
            f32(e["logprob"]),
            tuple(
                (t.get("token", t.get("token_id")), f32(t["logprob"]))
                for t in e.get("top_logprobs") or []
            ),
        )
        for e in logprobs["content"]
    ]


def _completion_entries(logprobs: dict[str, Any] | None) -> list[Entry] | None:
    if not logprobs:
        return None
    tops = logprobs.get("top_logprobs") or [{}] * len(logprobs["tokens"])
    return [
        Entry(token, f32(lp), tuple((t, f32(v)) for t, v in (top or {}).items()))
        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops, strict=True)
    ]


def _entries(choice: dict[str, Any]) -> list[Entry] | None:
    lp = choice.get("logprobs")
    return _completion_entries(lp) if lp and "tokens" in lp else _chat_entries(lp)


def _text(choice: dict[str, Any]) -> str | None:
    if "message" in choice:
        return str(choice["message"].get("content") or "")
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return choice.get("text")


def parse_whole(body: dict[str, Any]) -> Answer:
    """A non-streaming chat or completion answer (choice 0)."""
    choice = body["choices"][0]
    entries = _entries(choice)
    ids = choice.get("token_ids")
    return Answer(
        text=_text(choice),
        entries=None if entries is None else tuple(entries),
        token_ids=None if ids is None else tuple(ids),
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        completion_tokens=(body.get("usage") or {}).get("completion_tokens"),
    )


def parse_stream(chunks: list[dict[str, Any]]) -> Answer:
    """A streamed answer (choice 0), chunk by chunk: texts, logprob entries and token IDs
    concatenated; the last finish and stop reason seen; usage from the last chunk with it."""
    text: str | None = None
    entries: list[Entry] | None = None
    ids: list[int] | None = None
    answer = Answer()
    for chunk in chunks:
        if chunk.get("usage"):
            answer = replace(answer, completion_tokens=chunk["usage"].get("completion_tokens"))
        for choice in chunk.get("choices", []):
            piece, more = _text(choice), _entries(choice)
            if piece is not None:
                text = (text or "") + piece
            if more is not None:
                entries = (entries or []) + more
            if choice.get("token_ids") is not None:
                ids = (ids or []) + list(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                answer = replace(answer, finish_reason=choice["finish_reason"])
            if choice.get("stop_reason") is not None:
                answer = replace(answer, stop_reason=choice["stop_reason"])
    return replace(
        answer,
        text=text,
        entries=None if entries is None else tuple(entries),
        token_ids=None if ids is None else tuple(ids),
    )


# --------------------------------------------------------------------------- comparing


def _entry_diff(i: int, want: Entry, got: Entry, values_only: bool) -> str | None:
    if not values_only and want.token != got.token:
        return f"entry {i}: token {got.token!r}, vLLM {want.token!r}"
    if want.logprob != got.logprob:
        return f"entry {i}: logprob {got.logprob}, vLLM {want.logprob}"
    if values_only:
        # vLLM's completions key top candidates by text, so two that print alike (say two
        # halves of one character, both "") keep one key: by ID, the engine lists both
        top_ok = Counter(v for _, v in want.top) <= Counter(v for _, v in got.top)
    else:
        top_ok = want.top == got.top
    return None if top_ok else f"entry {i}: top {got.top!r}, vLLM {want.top!r}"


def _count(entries: tuple[Entry, ...] | None) -> str:
    return "no logprobs" if entries is None else f"{len(entries)} entries"


def entries_diff(
    want: tuple[Entry, ...] | None, got: tuple[Entry, ...] | None, values_only: bool = False
) -> str | None:
    """None when equal, else the first difference in words."""
    if want is None or got is None or len(want) != len(got):
        return None if want is got else f"{_count(got)}, vLLM {_count(want)}"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if (diff := _entry_diff(i, w, g, values_only)) is not None:
            return diff
    return None


def _short(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _same(got: object, want: object) -> str | None:
    return None if got == want else f"{_short(got)}, vLLM {_short(want)}"


def compare(want: Answer, got: Answer, engine: bool = False) -> dict[str, str | None]:
    """Field -> None when equal to vLLM's `want`, else the difference. The engine alone has no
    text or stop reason (its tokens are compared by ID, its logprobs by value)."""
    if got.error is not None or want.error is not None:
        return {"answer": f"error: {got.error}" if got.error else f"vLLM error: {want.error}"}
    out: dict[str, str | None] = {}
    if not engine:
        out["text"] = _same(got.text, want.text)
    out["logprobs"] = entries_diff(want.entries, got.entries, values_only=engine)
    if engine:
        out["token_ids"] = None if got.token_ids == want.token_ids else "token IDs differ"
    out["finish_reason"] = _same(got.finish_reason, want.finish_reason)
    if not engine:
        out["stop_reason"] = _same(got.stop_reason, want.stop_reason)
    out["completion_tokens"] = _same(got.completion_tokens, want.completion_tokens)
    return out


@dataclass
class Verdicts:
    """Per case and target, each field's difference from monolithic vLLM (None: equal)."""

    rows: dict[str, dict[str, dict[str, str | None]]] = field(default_factory=dict)

    def add(self, case: str, target: str, diffs: dict[str, str | None]) -> None:
        self.rows.setdefault(case, {})[target] = diffs

    def matches(self, target: str) -> tuple[int, int]:
        """(cases equal in every field, cases asked) for `target`."""
        asked = [r[target] for r in self.rows.values() if target in r]
        return sum(all(v is None for v in d.values()) for d in asked), len(asked)

    def to_json(self) -> dict[str, Any]:
        return {"cases": self.rows}


def judge(answers: dict[str, dict[str, Answer]], reference: str = "monolithic") -> Verdicts:
    """`answers[target][case]` against `answers[reference][case]`."""
    verdicts = Verdicts()
    for target, by_case in answers.items():
        if target == reference:
            continue
        for case, answer in by_case.items():
            want = answers.get(reference, {}).get(case)
            if want is None:
                continue
            verdicts.add(case, target, compare(want, answer, engine=target == "engine"))
    return verdicts


def markdown(verdicts: Verdicts) -> str:
    """One row per case, one column per target: 'equal', or each differing field and how."""
    targets = list(dict.fromkeys(t for row in verdicts.rows.values() for t in row))
    if not targets:
        return ""
    lines = [
        "**Exactness against monolithic vLLM** (greedy, top-2 logprobs; float32 logprobs)",
        "",
        "| case | " + " | ".join(targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    for case, row in verdicts.rows.items():
        cells = []
        for t in targets:
            diffs = row.get(t)
            if diffs is None:
                cells.append("n/a")
                continue
            bad = [f"{k}: {v}" for k, v in diffs.items() if v is not None]
            cells.append("equal" if not bad else "<br>".join(bad).replace("|", "\\|"))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        ", ".join(f"{t}: {m}/{n} cases equal" for t in targets for m, n in [verdicts.matches(t)])
    )
    return "\n".join(lines) + "\n"


def answers_json(answers: dict[str, dict[str, Answer]]) -> dict[str, Any]:
    return {t: {c: asdict(a) for c, a in by.items()} for t, by in answers.items()}


# --------------------------------------------------------------------------- asking


async def ask(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    """POST `body` to `url`; the answer, streamed or whole, reduced to an `Answer`."""
    async with session.post(url, json=body) as resp:
        raw = await resp.read()
    if resp.status != 200:
        return Answer(error=f"{resp.status} {raw[:200].decode(errors='replace')}")
    if not body.get("stream"):
        return parse_whole(json.loads(raw))
    try:
        return parse_stream(sse.chunks(raw))
    except sse.SseError as exc:
        return Answer(error=f"unreadable stream: {exc}")
