"""vLLM's own parsers, run in-process as the oracle, and our chain run the same way.

`vllm_whole` is what vLLM's non-streaming chat completion puts in the message (`Parser.parse`);
`vllm_streamed` replays vLLM's streaming path (`Parser.parse_delta` chunk by chunk) and joins
the deltas as a client would. Texts are decoded from real Qwen3-vocabulary token IDs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenline.services.derender.parsers.base import ParserOptions
from tokenline.services.derender.parsers.chain import build
from tokenline.services.derender.parsers.pieces import Piece, assemble
from tokenline.services.derender.parsers.schema import tool_properties

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                    "tags": {"type": "array", "items": {"type": "integer"}},
                    "unit": {"enum": ["c", "f", None]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]
PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

Result = tuple[str | None, str | None, list[tuple[str, str]]]
"""(reasoning, content, [(name, arguments)]): a message's parsed fields."""


@dataclass(frozen=True)
class Case:
    reasoning: str | None
    tool: str | None
    tool_choice: str = "auto"
    enable_thinking: bool = True
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: TOOLS)

    def options(self, special_tokens: frozenset[str]) -> ParserOptions:
        counter = itertools.count()
        return ParserOptions(
            special_tokens=special_tokens,
            tools=tool_properties(self.tools or []),
            tool_choice=self.tool_choice if self.tools else "none",  # type: ignore[arg-type]
            enable_thinking=self.enable_thinking,
            new_id=lambda: f"chatcmpl-tool-{next(counter):016x}",
        )


COMBOS = [
    (r, t)
    for r in (None, "qwen3", "deepseek_r1")
    for t in (None, "hermes", "qwen3_coder")
    if (r, t) != (None, None)
]


class Vllm:
    """vLLM's composed parser for one tokenizer, as `vllm serve` builds it per request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.special_tokens = frozenset(tokenizer.all_special_tokens)
        self._classes: dict[tuple[str | None, str | None], Any] = {}

    def load(self, combos: Sequence[tuple[str | None, str | None]]) -> None:
        """Import vLLM's parser classes now (the first import warns about deprecations)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser.parser_manager import ParserManager

        self._request_cls = ChatCompletionRequest
        for reasoning, tool in combos:
            self._classes[reasoning, tool] = ParserManager.get_parser(
                tool_parser_name=tool,
                reasoning_parser_name=reasoning,
                enable_auto_tools=tool is not None,
            )

    def _request(self, case: Case) -> Any:
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        if case.tools:
            body |= {"tools": case.tools, "tool_choice": case.tool_choice}
        return self._request_cls(**body)

    def _parser(self, case: Case, request: Any) -> Any:
        key = (case.reasoning, case.tool)
        kwargs = {"enable_thinking": case.enable_thinking}
        return self._classes[key](self.tok, request.tools, chat_template_kwargs=kwargs)

    def whole(self, case: Case, text: str) -> Result:
        request = self._request(case)
        parser = self._parser(case, request)
        reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True)
        return reasoning, content, [(c.name, c.arguments) for c in calls or []]

    def reasoning_tokens(self, case: Case, ids: list[int]) -> int:
        """vLLM's `completion_tokens_details.reasoning_tokens` for a whole output."""
        request = self._request(case)
        parser = self._parser(case, request)
        text = self.tok.decode(ids)
        parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)
        return int(parser.count_reasoning_tokens(ids))

    def streamed(self, case: Case, chunks: Sequence[tuple[list[int], str]]) -> Result:
        request = self._request(case)
        parser = self._parser(case, request)
        prompt = self.tok.encode(PROMPT, add_special_tokens=False)
        deltas = [
            parser.parse_delta(text, ids, request, prompt, finished=i == len(chunks) - 1)
            for i, (ids, text) in enumerate(chunks)
        ]
        calls: dict[int, list[str]] = {}
        for delta in filter(None, deltas):
            for call in delta.tool_calls or []:
                name = call.function.name if call.function else None
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += name or ""
                entry[1] += (call.function.arguments or "") if call.function else ""
        reasoning = "".join(d.reasoning or "" for d in deltas if d) or None
        content = "".join(d.content or "" for d in deltas if d) or None
        return reasoning, content, [(n, a) for _, (n, a) in sorted(calls.items())]


def result(pieces: Sequence[Piece]) -> Result:
    message = assemble(pieces)
    return message.reasoning, message.content, [(c.name, c.arguments) for c in message.tool_calls]


def ours(case: Case, special: frozenset[str], chunks: Sequence[tuple[list[int], str]]) -> Result:
    chain = build(case.reasoning, case.tool, case.options(special))
    pieces = [p for ids, text in chunks for p in chain.feed(ids, text)]
    return result(pieces + chain.flush())


def token_texts(tok: Any, ids: Sequence[int]) -> list[str]:
    """Each token's text, as an incremental detokenizer emits it (a token ending inside a
    UTF-8 sequence adds nothing until the sequence completes)."""
    texts, done = [], 0
    for i in range(len(ids)):
        start = max(0, done - 4)
        before = tok.decode(ids[start:done], skip_special_tokens=False)
        after = tok.decode(ids[start : i + 1], skip_special_tokens=False)
        if after.endswith("\ufffd") and i < len(ids) - 1:
            texts.append("")
            continue
        texts.append(after[len(before) :])
        done = i + 1
    return texts


def per_token(tok: Any, text: str) -> list[tuple[list[int], str]]:
    ids = tok.encode(text, add_special_tokens=False)
    return [([i], t) for i, t in zip(ids, token_texts(tok, ids), strict=True)]


def flat(result: Result) -> Result:
    """A streamed result as a client sees it: no content and empty content are the same."""
    reasoning, content, calls = result
    return reasoning or None, content or None, calls
