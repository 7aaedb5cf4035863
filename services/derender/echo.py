"""What an answer shows of its prompt besides the output (pure), as monolithic vLLM shows it.

* chat: the answer's role, and with `echo` the last message's text ahead of each choice's
  content when that message has the answer's role (`chat_role`, `chat_echo`);
* completions: with `echo`, each choice starts with its prompt's text and, with `logprobs`,
  the prompt tokens' logprobs (from the engine's prompt logprobs, the first position null).

A stream shows the echo once per choice, in its first chunk: for chat, with the role, ahead of
the first text (as vLLM's own scale-out derender does). tokenline's proxy asks for neither: it
opens a chat stream as monolithic vLLM does, with a role chunk per choice and then an echo chunk
per choice of their own (`proxy/flow/chunks.py`, `StreamFlow.opening`). `chat_role` and `chat_echo`
live in `shared/kinds.py`, for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.services.derender.logprobs import prompt_completion_logprobs
from tokenline.services.derender.parts import is_id_list
from tokenline.shared.errors import BadRequest
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    CompletionLogprobs,
    CompletionRequest,
    PromptLogprobs,
    nth_prompt,
)


@dataclass(frozen=True)
class Echo:
    """A completions choice's echoed prompt: text, and logprobs when the client asked."""

    text: str
    logprobs: CompletionLogprobs | None

    def joined(self, out: CompletionLogprobs | None) -> CompletionLogprobs | None:
        """These logprobs followed by the output's (offset by `end()` already)."""
        if self.logprobs is None or out is None:
            return self.logprobs or out
        return CompletionLogprobs(
            text_offset=[*self.logprobs.text_offset, *out.text_offset],
            token_logprobs=[*self.logprobs.token_logprobs, *out.token_logprobs],
            tokens=[*self.logprobs.tokens, *out.tokens],
            top_logprobs=[*self.logprobs.top_logprobs, *out.top_logprobs],
        )

    def end(self) -> int:
        """The text offset the output's first logprob token starts at."""
        lp = self.logprobs
        return lp.text_offset[-1] + len(lp.tokens[-1]) if lp is not None and lp.tokens else 0


def echo_only(request: CompletionRequest | None) -> bool:
    """`echo` with `max_tokens` 0: the answer shows the prompt alone (render asks the engine
    for one token, which counts in the usage and sets the finish reason, as in vLLM)."""
    return request is not None and request.echo and request.max_tokens == 0


def prompt_text(tok: ModelTokenizer, request: CompletionRequest, p: int) -> str:
    """Prompt `p` as vLLM echoes it: the text sent, or the IDs sent decoded with special tokens
    kept (before any truncation, as vLLM decodes them); nothing with `return_token_ids`."""
    if request.return_token_ids:
        return ""
    prompt = nth_prompt(request.prompt, p)
    if isinstance(prompt, str):
        return prompt
    if not is_id_list(prompt) or any(t >= tok.vocab_size for t in prompt):
        raise BadRequest(f"prompt {p} is not a list of token IDs", param="prompt")
    return tok.decode(prompt, skip_special_tokens=False)


def completion_echo(
    tok: ModelTokenizer,
    request: CompletionRequest | None,
    p: int,
    prompt_ids: list[int] | None,
    prompt_logprobs: PromptLogprobs | None,
) -> Echo | None:
    """Prompt `p`'s echo (None without `echo`). `prompt_logprobs`: decoded, as
    `decoded_prompt_logprobs` leaves them; needed only when the client asked for logprobs."""
    if request is None or not request.echo:
        return None
    text = prompt_text(tok, request, p)
    if request.logprobs is None:
        return Echo(text, None)
    ids, entries = _aligned(prompt_ids, prompt_logprobs)
    return Echo(text, prompt_completion_logprobs(tok, ids, entries, request.logprobs))


def _aligned(
    prompt_ids: list[int] | None, entries: PromptLogprobs | None
) -> tuple[list[int], PromptLogprobs]:
    """Echo with logprobs needs one prompt logprob entry per prompt token, each holding that
    token (the engine's prompt logprobs for this very prompt)."""
    if prompt_ids is None:
        raise BadRequest(
            "echo with logprobs needs the prompt's token IDs", param="prompt_token_ids"
        )
    if entries is None:
        raise BadRequest(
            "echo with logprobs needs the generate answer's prompt_logprobs",
            param="prompt_logprobs",
        )
    if len(entries) != len(prompt_ids) or any(
        e is not None and t not in e for t, e in zip(prompt_ids, entries, strict=True)
    ):
        raise BadRequest(
            "prompt_logprobs do not match the prompt's token IDs", param="prompt_logprobs"
        )
    return prompt_ids, entries
