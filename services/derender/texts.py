"""What derender knows of each token on its own, per tokenizer, computed once per process.

- A logprob entry's token and bytes (`standalone`): every entry shows the sampled token and its
  candidates; a token whose text does not end in U+FFFD shows the same whatever came before, and
  so does a byte-level token with a byte that starts a character afresh and whose bytes end
  cut (its repair reports "" in any context: `corrected`).
- Window decodes without the tokenizer (`decode`): a byte-level decoder maps each token's
  characters back to bytes (GPT-2's byte-to-character table; a token with a character outside
  it contributes its own UTF-8) and reads the concatenation as lossy UTF-8, which Python's
  "replace" reads alike (both substitute U+FFFD per maximal ill-formed subpart: checked against
  the tokenizer in tests). Each token's bytes are kept once, so the detokenizer's and the
  logprob repair's short windows cost a join instead of a call into the tokenizer. Windows with
  an added token, or past the tokenizer, still go to it (added tokens have their own rules).
  That saves ~3 us of derender CPU per token (~20%): in `.venv/bin/python -m research.hop
  --transports batched`, against the same code sending `decode` to the tokenizer and
  `corrected` to the general repair, interleaved in one run (ABBA, 8 blocks), 13.6 us per
  token with the table, +2.7 us without (paired difference, IQR +1.5..+3.7); with `logprobs`
  and `top_logprobs=2`, 19.1 us, +2.9 us (IQR +2.7..+4.0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import msgspec
from tokenizers.decoders import ByteLevel

from tokenline.shared.limits import LOGPROB_CONTEXT
from tokenline.shared.tokenizer import ModelTokenizer

REPLACEMENT = "\ufffd"


class Decoded(msgspec.Struct, frozen=True, gc=False):
    """A logprob token's text and UTF-8 bytes (a Struct: a repaired token builds one)."""

    token: str
    bytes: list[int] | None


NOTHING = Decoded("", [])


@dataclass
class TokenTexts:
    tok: ModelTokenizer
    byte_level: bool
    plain: list[bytes | None] = field(default_factory=list)
    """Byte-level only: each token's bytes by ID, None for an added token (empty otherwise)."""
    decoded: dict[int, Decoded | None] = field(default_factory=dict)
    """`standalone`'s cache, bounded by the vocabulary (the bytes lists are shared, never
    changed); None for a token whose text depends on the tokens before it."""

    bytes_of: Callable[[int], bytes] = field(init=False, repr=False, compare=False)
    """The byte table's lookup, typed as if every entry were bytes: an added token's None fails
    the join that follows (TypeError), an ID past the table the lookup (IndexError). (Kept
    bound: every window decode runs it.)"""

    def __post_init__(self) -> None:
        self.bytes_of = cast(list[bytes], self.plain).__getitem__

    @classmethod
    def of(cls, tok: ModelTokenizer) -> TokenTexts:
        byte_level = isinstance(tok.rust.decoder, ByteLevel)
        added = frozenset(tok.added_tokens)
        return cls(tok, byte_level, _token_bytes(tok, added) if byte_level else [])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """`tok.decode(ids, skip_special_tokens)`, from the byte table when every ID is a
        plain byte-level token (then skipping special tokens changes nothing)."""
        try:
            return b"".join(map(self.bytes_of, ids)).decode("utf-8", "replace")
        except (IndexError, TypeError):  # an ID past the table, or an added token's None
            return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def corrected(self, token_id: int, context: Sequence[int]) -> str | None:
        """`logprobs.correct_decoded_token` from the byte table (its windows are joins of
        bytes), for a plain byte-level token whose own text ends in U+FFFD with plain context;
        None otherwise (the general path then)."""
        plain = self.plain
        size = len(plain)
        tail = plain[token_id] if token_id < size else None
        window = context[-LOGPROB_CONTEXT:]
        found = [plain[i] if i < size else None for i in window]
        if tail is None or None in found:
            return None
        parts = cast(list[bytes], found)
        if tail[0] < 0x80 or tail[0] >= 0xC0:
            # UTF-8 starts afresh at a byte that cannot continue a character: whatever came
            # before decodes on its own, so every window ends as the token alone does
            return "" if tail.decode("utf-8", "replace").endswith(REPLACEMENT) else None
        before = b""
        for n in range(1, len(parts) + 1):
            before = parts[-n] + before
            full = (before + tail).decode("utf-8", "replace")
            if full.endswith(REPLACEMENT):
                continue
            first = len(parts) - n  # the window is window[first:]
            clean_end = n  # ... without its trailing tokens whose own text ends in U+FFFD
            while clean_end and self.ends_cut(window[first + clean_end - 1]):
                clean_end -= 1
            prefix = b"".join(parts[first : first + clean_end]).decode("utf-8", "replace")
            return after_prefix(full, prefix)
        return ""

    def ends_cut(self, token_id: int) -> bool:
        """The token's own text ends in U+FFFD (a character it does not finish)."""
        return self.tok.decode_one(token_id).endswith(REPLACEMENT)

    def standalone(self, token_id: int) -> Decoded | None:
        """The token's text and UTF-8 bytes when they are the same whatever came before it;
        None when they depend on those tokens (its text ends in U+FFFD and needs repair)."""
        try:
            return self.decoded[token_id]
        except KeyError:  # a token's first time (then one lookup, for the cut ones too)
            found = self.decoded[token_id] = self._standalone(token_id)
            return found

    def _standalone(self, token_id: int) -> Decoded | None:
        text = self.tok.decode_one(token_id)
        if not text.endswith(REPLACEMENT):
            return Decoded(text, list(text.encode("utf-8", "replace")))
        return NOTHING if self._cut_after_a_fresh_start(token_id) else None

    def _cut_after_a_fresh_start(self, token_id: int) -> bool:
        """A plain byte-level token with a byte that cannot continue a character (ASCII or a
        lead byte), whose bytes end cut: `corrected` repairs it to "" whatever the context.
        UTF-8 decodes afresh from that byte whatever came before it, so every window ends as
        the token alone does: in U+FFFD."""
        tail = self.plain[token_id] if token_id < len(self.plain) else None
        if tail is None or all(0x80 <= b < 0xC0 for b in tail):
            return False
        return tail.decode("utf-8", "replace").endswith(REPLACEMENT)


def after_prefix(full: str, prefix: str) -> str:
    """What `full` adds after `prefix` (after their common start, if it does not start so)."""
    if full.startswith(prefix):
        return full[len(prefix) :]
    common = 0
    for a, b in zip(prefix, full, strict=False):
        if a != b:
            break
        common += 1
    return full[common:]


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte. Printable
    Latin-1 bytes stand for themselves; the other 68 are shifted to 256 and up, in order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def _token_bytes(tok: ModelTokenizer, added: frozenset[int]) -> list[bytes | None]:
    chars = _byte_chars()
    found: list[bytes | None] = [None] * tok.tokenizer_size
    for piece, token_id in tok.rust.get_vocab(with_added_tokens=False).items():
        if token_id in added or token_id >= len(found):
            continue
        if all(c in chars for c in piece):
            found[token_id] = bytes(chars[c] for c in piece)
        else:  # as the byte-level decoder does: a piece it cannot map is its own UTF-8
            found[token_id] = piece.encode()
    return found


_TEXTS: dict[int, TokenTexts] = {}
"""By tokenizer identity; each entry holds its tokenizer, so an identity is never reused (a
process has one or a few, loaded for its lifetime)."""


def token_texts(tok: ModelTokenizer) -> TokenTexts:
    found = _TEXTS.get(id(tok))
    if found is None:
        found = _TEXTS[id(tok)] = TokenTexts.of(tok)
    return found
