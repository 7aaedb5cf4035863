"""`POST /detokenize`: token IDs back to text, as vLLM answers it (pure).

vLLM decodes the whole list with `tokenizer.decode(ids)` (special tokens kept), and silently
drops an ID its tokenizer does not know. tokenline checks every ID against the model's
vocabulary first, as derender's bounds do for generated tokens: one past it is a 400 naming
`tokens`. IDs inside the vocabulary but past the tokenizer (padding rows) decode to nothing,
as in vLLM.
"""

from __future__ import annotations

from tokenline.services.derender.bounds import DerenderSettings, _check_ids, model_name
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import DetokenizeRequest, DetokenizeResponse


def detokenize(
    asked: DetokenizeRequest, tok: ModelTokenizer, settings: DerenderSettings
) -> DetokenizeResponse:
    model_name(asked.model, settings)
    _check_ids(asked.tokens, tok, "tokens")
    return DetokenizeResponse(prompt=tok.decode(asked.tokens, skip_special_tokens=False))
