"""Which tokens the detokenizer may append as their own text (its fast path).

Byte-level BPE decodes a sequence as its tokens' bytes, concatenated and read as UTF-8: after
text that ends on a character boundary, a token whose bytes are whole characters adds exactly
its own text (`ModelTokenizer.decode_one`, cached), so one dictionary lookup replaces the two
window decodes of the general algorithm. SentencePiece-style decoders strip a leading space
from the first token of a decode instead, and added tokens (special or not) have spacing rules
around them: those always take the general path.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import ByteLevel

from tokenline.shared.tokenizer import ModelTokenizer


@dataclass(frozen=True)
class FastPath:
    """Per tokenizer: whether its decoder is byte-level, and the IDs that never go fast."""

    tok: ModelTokenizer
    byte_level: bool
    added: frozenset[int]

    @classmethod
    def of(cls, tok: ModelTokenizer) -> FastPath:
        return cls(tok, isinstance(tok.rust.decoder, ByteLevel), frozenset(tok.added_tokens))

    def own_text(self, token_id: int) -> str | None:
        """The text `token_id` adds after text ending on a character boundary, when that is
        its own text (None: decode the window)."""
        if not self.byte_level or token_id in self.added:
            return None
        text = self.tok.decode_one(token_id)
        return text if text and "\ufffd" not in text else None


_PATHS: dict[int, FastPath] = {}
"""By tokenizer identity; each entry holds its tokenizer, so an identity is never reused (a
process has one or a few, loaded for its lifetime)."""


def fast_path(tok: ModelTokenizer) -> FastPath:
    found = _PATHS.get(id(tok))
    if found is None:
        found = _PATHS[id(tok)] = FastPath.of(tok)
    return found
