"""Reasoning and tool-call parsers for derender: vLLM 0.32's answers, streamed (sans-IO).

Interface
---------
`build(reasoning, tool, options, state=None) -> Chain` composes the parsers a vLLM server runs
for `--reasoning-parser` and `--tool-call-parser` (None: not configured, or auto tool choice
off). The registries `REASONING_PARSERS` (`qwen3`, `deepseek_r1`) and `TOOL_PARSERS` (`hermes`,
`qwen3_coder`) map each name to its factory and the vLLM class it mirrors; a single parser is
`spec.new(options, None)` (tool parsers also take a `Placement`). Every parser, and the chain:

    feed(token_ids: Sequence[int], text: str) -> list[Piece]   # a chunk of output tokens and
                                                               # the text they decoded to
    flush() -> list[Piece]                                     # the stream ended
    state -> msgspec.Struct                                    # all there is to carry

A `Piece` is `Reasoning(text, tokens)`, `Content(text, tokens)` or `ToolCallDelta(index, id,
type, name, arguments, tokens)`; `tokens` is the half-open range of output positions whose text
produced it. `assemble(pieces) -> Message(content, reasoning, tool_calls)` is what a client
rebuilds; the non-streaming answer is the same chain fed the whole output once, then flushed,
then assembled, and equals vLLM's `Parser.parse` (what its chat completion message carries),
`None` versus `""` included. Between chunks derender returns `chain.state` (a `ChainState`,
msgspec-encodable, JSON or msgpack) and rebuilds the chain from it: `build(..., state=...)`.

`ParserOptions` holds what vLLM takes from the request and tokenizer: `tokenizer.
all_special_tokens` (the engine parsers drop those that are not their markup), the tools
(`schema.tool_properties(request.tools)`), `tool_choice`, `enable_thinking` and `new_id` (tool
call ids are `chatcmpl-tool-` + 16 random hex digits, vLLM's `make_tool_call_id`; inject a
counter in tests). The text fed must be decoded as vLLM decodes it after the parsers'
`adjust_request`: `skip_special_tokens=False` whenever qwen3 or qwen3_coder is configured, and
for hermes when the request has tools and `tool_choice != "none"`.

What vLLM 0.32 does, and what we do
-----------------------------------
- Composition: `ParserManager` wraps the two parsers in a `DelegatingParser`: reasoning first,
  its content to the tool parser. qwen3 and qwen3_coder are adapters over one parser engine
  (`vllm/parser/qwen3.py`); hermes and deepseek_r1 are legacy classes, and a pair with a legacy
  parser is composed the legacy way (see `chain`, `qwen3_coder`).
- Reasoning left open by the prompt: vLLM's non-streaming answer never looks at the prompt.
  qwen3 starts in reasoning exactly when `enable_thinking` (chat_template_kwargs, default true;
  `reasoning_effort="none"` sets it false); deepseek_r1 always does. The prompt matters to vLLM's
  streaming (`is_reasoning_end(prompt_token_ids)` ends reasoning before the first token) and to
  structured outputs (`reasoning_ended`, when the grammar starts to apply):
  `REASONING_PARSERS[name].reasoning_ended_in_prompt(prompt_ids, vocab, options)` computes it.
- tool_choice: while `VLLM_ENFORCE_STRICT_TOOL_CALLING` is on (default) hermes and qwen3_coder
  have `supports_required_and_named = False`, so "required" and named choices parse as "auto"
  (an empty or whitespace-only content then becomes `None`); generation is constrained by an
  xgrammar structural tag, not a JSON schema. "none" skips the tool parser unless both parsers
  are engine-based (then the markup is still removed from content).
- Left to the caller, as vLLM's serving layer does it: named/required messages carry
  `content or ""`; `finish_reason` "tool_calls" when calls stand (not for a named choice);
  `parallel_tool_calls=false` keeps only the call of index 0; `include_reasoning=false` drops
  reasoning and also logprobs and token IDs.
- Logprobs: vLLM attaches no logprobs per piece. Streaming, each SSE chunk is one engine step
  and carries the logprobs of all that step's tokens, whatever the parser made of them
  (reasoning, content, a tool delta, or nothing: a chunk with an empty delta is still sent when
  logprobs or token IDs were asked for); non-streaming, the choice carries all output tokens'
  logprobs. `Piece.tokens` tells which tokens made a piece, should finer alignment be wanted.
- vLLM's streaming answer differs from its own non-streaming one in many places (tool calls
  streamed before a later bad call turns them into content, whitespace the whole answer strips,
  text after a call, partial arguments of a truncated call, text before a late `<think>`); we
  stream the non-streaming answer (`tests/services/derender/parsers/test_vs_vllm.py` lists the
  cases).

State and bounds
----------------
No parser replays the output: a chunk costs its own length plus what is held, never the output
already sent (a flush makes one pass over what is held). What is held between chunks,
documented per module: a tail that may start a tag or special token (shorter than the longest);
deepseek_r1's first `think_window` characters; content whose whitespace vLLM may still strip
(up to `content_lookahead`: qwen3_coder's content starting with whitespace, trailing whitespace
runs, hermes' whitespace-only content); and for tool calls the text from the first call on,
held until `flush` because vLLM's answer for any call depends on the calls after it. That region
is bounded by `max_held` (65536 characters by default); past it a parser raises
`ParserLimitExceeded` rather than grow. Token ranges are kept only for held characters
(`tests/services/derender/parsers/test_bounds.py`: under 2 KB of msgpack over a 4,000-token answer).

Known divergences (bounded, documented in their modules): deepseek_r1 ignores a `<think>` that
starts `think_window` characters or more into the output; qwen3_coder keeps leading whitespace
of content longer than `content_lookahead` before a call; deepseek_r1 + qwen3_coder keeps
`</think>` and special tokens in content before a call; a call whose JSON `name` is not a string
(vLLM fails the request) is no call.
"""

from tokenline.services.derender.parsers.base import (
    MAX_HELD,
    ParserLimitExceeded,
    ParserOptions,
    make_tool_call_id,
)
from tokenline.services.derender.parsers.chain import Chain, ChainState, build
from tokenline.services.derender.parsers.pieces import (
    Content,
    Message,
    Piece,
    Reasoning,
    ToolCallDelta,
    assemble,
)
from tokenline.services.derender.parsers.registry import REASONING_PARSERS, TOOL_PARSERS
from tokenline.services.derender.parsers.schema import tool_properties

__all__ = [
    "MAX_HELD",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Chain",
    "ChainState",
    "Content",
    "Message",
    "ParserLimitExceeded",
    "ParserOptions",
    "Piece",
    "Reasoning",
    "ToolCallDelta",
    "assemble",
    "build",
    "make_tool_call_id",
    "tool_properties",
]
