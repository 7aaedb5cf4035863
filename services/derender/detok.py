"""Incremental detokenization whose state fits in a small, serializable window (sans-IO).

The algorithm is the one monolithic vLLM runs for fast tokenizers (`tokenizers`'
`DecodeStream`): decode the window of IDs since the last emission, emit what extends the
previous decode, and hold everything back while the text ends in U+FFFD (an incomplete UTF-8
sequence). Keeping the state as token IDs (not token strings) lets a stateless server check it:
a forged window is just IDs, validated against the vocabulary like any other.

The window stays within `DETOK_STATE_IDS` for any token sequence: IDs the tokenizer drops before
decoding (skipped special tokens, padding rows) never enter it, a held-back part reaching
`DETOK_MAX_WINDOW` is emitted, and the emitted part is cut from the left when the held-back
part grows long (it keeps `DETOK_STATE_IDS - DETOK_MAX_WINDOW + 1` IDs, more than the
`DETOK_PROMPT_SEED` of context a stream starts with).
"""

from __future__ import annotations

import msgspec

from tokenline.services.derender.texts import REPLACEMENT, TokenTexts, token_texts
from tokenline.shared.limits import DETOK_MAX_WINDOW, DETOK_PROMPT_SEED, DETOK_STATE_IDS
from tokenline.shared.tokenizer import ModelTokenizer


class DetokState(msgspec.Struct, gc=False):
    """`ids[:prefix]` is the text already emitted; `ids[prefix:]` is held back; `head` goes in
    front of the next text emitted (`seed`)."""

    ids: list[int] = []
    prefix: int = 0
    last_special: bool = False
    head: str = ""


def seed(prompt_ids: list[int] | None, tok: ModelTokenizer, skip: bool) -> DetokState:
    """The state after the prompt, as vLLM primes `DecodeStream` with the whole prompt.

    A prompt whose text ends in U+FFFD (a cut character, or a literal one) never becomes
    DecodeStream's prefix: its first emission is the decode of prompt and output together, the
    prompt's text included. Here that prompt is cut where its text last ends cleanly: the part
    after the cut is held back like output, and the part before it (`head`) goes in front of
    the first text (the same text for decoders whose output is the concatenation of the
    tokens' bytes; checked against DecodeStream in tests). The cut is looked for within the
    window the detokenizer may hold back (a longer run of garbage ends in it, where vLLM would
    reach further back)."""
    ids = prompt_ids or []  # (read only: the state keeps slices of it)
    texts = token_texts(tok)
    cut = len(ids)
    while cut > max(0, len(ids) - DETOK_MAX_WINDOW + 1) and _ends_cut(texts, ids, cut, skip):
        cut -= 1
    start = max(0, cut - DETOK_PROMPT_SEED)
    head = texts.decode(ids[:cut], skip) if cut < len(ids) else ""
    return DetokState(ids=ids[start:], prefix=cut - start, head=head)


def _ends_cut(texts: TokenTexts, ids: list[int], end: int, skip: bool) -> bool:
    """`decode(ids[:end])` ends in U+FFFD, read from its last IDs (they hold the last
    character's bytes) unless those decode to nothing (skipped special tokens)."""
    window = texts.decode(ids[max(0, end - DETOK_PROMPT_SEED) : end], skip)
    if window:
        return window.endswith(REPLACEMENT)
    return texts.decode(ids[:end], skip).endswith(REPLACEMENT)


class Detokenizer:
    """`feed(token_id) -> str`: the text this token adds (often "" while bytes are pending).

    One is built per chunk (a plain class with slots: that costs less than a dataclass)."""

    __slots__ = ("skip_special_tokens", "spaces_between_special_tokens", "state", "texts", "tok")

    def __init__(
        self,
        tok: ModelTokenizer,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        state: DetokState,
    ) -> None:
        self.tok = tok
        self.texts: TokenTexts = token_texts(tok)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.state = state

    def feed(self, token_id: int) -> str:
        # An ID the tokenizer drops before decoding (a skipped special token, a padding row)
        # shows nothing: leaving it out of the window changes no text, as in DecodeStream,
        # whose window would only grow with it. (Tested inline: this runs for every token.)
        tok = self.tok
        shows = token_id < tok.tokenizer_size and not (
            self.skip_special_tokens and token_id in tok.special_ids
        )
        text = self._step(token_id) if shows else ""
        if not (self.skip_special_tokens or self.spaces_between_special_tokens):
            # vLLM's quirk for spaces_between_special_tokens=False: a special token right after
            # another is emitted as its own content.
            special = self.tok.added_tokens.get(token_id)
            if special is not None and self.state.last_special:
                text = special
            self.state.last_special = special is not None
        if text and self.state.head:  # the prompt's part of the first emission (`seed`)
            text, self.state.head = self.state.head + text, ""
        return text

    def _step(self, token_id: int) -> str:
        state = self.state
        ids = [*state.ids, token_id]
        texts, skip = self.texts, self.skip_special_tokens
        text = texts.decode(ids, skip)
        room = len(ids) - state.prefix < DETOK_MAX_WINDOW
        # a window ending in a cut character is held back whatever its emitted part decodes
        # to: that decode waits for a window that may show (most windows of cut characters)
        held = text.endswith(REPLACEMENT)
        if not (held and room):
            prefix_text = texts.decode(ids[: state.prefix], skip)
            held = held or len(text) <= len(prefix_text)
        if held and room:
            cut = max(0, len(ids) - DETOK_STATE_IDS)  # the emitted part cut from the left
            state.ids, state.prefix = ids[cut:], state.prefix - cut
            return ""
        if not text.startswith(prefix_text):
            # DecodeStream's "invalid prefix": vLLM restarts the stream from this token alone.
            state.ids, state.prefix = [], 0
            return self._step(token_id)
        new_window = ids[state.prefix :]
        state.ids, state.prefix = new_window, len(new_window)
        return text[len(prefix_text) :]
