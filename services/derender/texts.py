"""What derender knows of each token on its own, per tokenizer, computed once per process.

- The detokenizer's fast path (`own_text`): byte-level BPE decodes a sequence as its tokens'
  bytes, concatenated and read as UTF-8, so after text that ends on a character boundary a
  token whose bytes are whole characters adds exactly its own text (`ModelTokenizer.decode_one`,
  cached): one lookup replaces the two window decodes of the general algorithm.
  SentencePiece-style decoders strip a leading space from the first token of a decode instead,
  and added tokens (special or not) have spacing rules around them: those always take the
  general path.
- A logprob entry's token and bytes (`standalone`): every entry shows the sampled token and its
  candidates; a token whose text does not end in U+FFFD shows the same whatever came before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import ByteLevel

from tokenline.shared.tokenizer import ModelTokenizer

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Decoded:
    token: str
    bytes: list[int] | None


@dataclass
class TokenTexts:
    tok: ModelTokenizer
    byte_level: bool
    added: frozenset[int]
    decoded: dict[int, Decoded] = field(default_factory=dict)
    """`standalone`'s cache, bounded by the vocabulary (the bytes lists are shared, never
    changed)."""

    @classmethod
    def of(cls, tok: ModelTokenizer) -> TokenTexts:
        return cls(tok, isinstance(tok.rust.decoder, ByteLevel), frozenset(tok.added_tokens))

    def own_text(self, token_id: int) -> str | None:
        """The text `token_id` adds after text ending on a character boundary, when that is
        its own text (None: decode the window)."""
        if not self.byte_level or token_id in self.added:
            return None
        text = self.tok.decode_one(token_id)
        return text if text and REPLACEMENT not in text else None

    def standalone(self, token_id: int) -> Decoded | None:
        """The token's text and UTF-8 bytes, unless its text ends in U+FFFD (then they depend
        on the tokens before it)."""
        found = self.decoded.get(token_id)
        if found is None:
            text = self.tok.decode_one(token_id)
            if text.endswith(REPLACEMENT):
                return None
            found = self.decoded[token_id] = Decoded(text, list(text.encode("utf-8", "replace")))
        return found


_TEXTS: dict[int, TokenTexts] = {}
"""By tokenizer identity; each entry holds its tokenizer, so an identity is never reused (a
process has one or a few, loaded for its lifetime)."""


def token_texts(tok: ModelTokenizer) -> TokenTexts:
    found = _TEXTS.get(id(tok))
    if found is None:
        found = _TEXTS[id(tok)] = TokenTexts.of(tok)
    return found
