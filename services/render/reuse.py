"""A chat's prompt token IDs forwarded in `kv_transfer_params` (pure).

In disaggregated serving the prefill side may forward the prompt's token IDs to the decode side
in `kv_transfer_params["prompt_token_ids"]`, and vLLM's chat render then takes them as the
prompt instead of templating the messages again (checks on tools and the template still run).
It always takes the key out of the parameters it passes on. With `echo` (the answer repeats the
messages' text), or messages with other parts than text (the IDs would drop them), the messages
are rendered all the same, and the IDs are neither used nor checked.
IDs that are no list of non-negative integers, or lie beyond both the tokenizer's and the
model's vocabulary, are a 400 naming the key. Completions never read the key.
"""

from __future__ import annotations

from typing import Any

from tokenline.services.render.sampling import check_token_ids
from tokenline.shared.errors import BadRequest
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import ChatCompletionRequest, ChatMessage

KEY = "prompt_token_ids"
PARAM = f"kv_transfer_params.{KEY}"


def split(kv: dict[str, Any] | None) -> tuple[Any, dict[str, Any] | None]:
    """(the forwarded IDs or None, the parameters passed on without them: None if none are
    left, as vLLM then passes none)."""
    if kv is None or KEY not in kv:
        return None, kv
    return kv[KEY], {k: v for k, v in kv.items() if k != KEY} or None


def _not_text_only(messages: list[ChatMessage]) -> bool:
    return any(
        isinstance(m.content, list) and any(part.type != "text" for part in m.content)
        for m in messages
    )


def reused_ids(ids: Any, request: ChatCompletionRequest, tok: ModelTokenizer) -> list[int] | None:
    """The forwarded IDs to use as the prompt, checked; None: render the messages."""
    if ids is None or request.echo or _not_text_only(request.messages):
        return None
    # bool is an int to Python, and never a token ID
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise BadRequest(
            f"`kv_transfer_params['{KEY}']` must be a non-empty list of non-negative integers.",
            param=PARAM,
        )
    check_token_ids(ids, max(tok.vocab_size, tok.tokenizer_size), PARAM)
    return ids
