"""Numbers more than one tier must agree on, each defined once.

Render refuses what generate could not do, derender bounds what a stream state may hold, and the
proxy asks generate for what derender needs; every one of them reads these.
"""

from __future__ import annotations

MAX_LOGPROBS = 20
"""vLLM's default `max_logprobs`: the most candidates a request may ask for per position."""

LOGPROB_CONTEXT = 4
"""Token IDs kept before a logprob token to decode a byte-fallback piece in context (derender
carries them in `stream_state.logprob_context_token_ids`)."""

DETOK_PROMPT_SEED = 6
"""Prompt IDs that seed the detokenizer: enough for any UTF-8 sequence and a space marker."""

DETOK_MAX_WINDOW = 64
"""A held-back window this long means garbage bytes: emit rather than grow without bound."""

DETOK_STATE_IDS = DETOK_PROMPT_SEED + DETOK_MAX_WINDOW + 2
"""The most IDs `stream_state.detok_ids` may hold, a cap derender enforces for any token
sequence: the held-back part stays under DETOK_MAX_WINDOW and the emitted part (context) is cut
from the left."""

DETOK_HEAD_CHARS = 1 << 22
"""The most characters `stream_state.detok_head` may hold: a prompt's text, which render
bounds by `max_model_len` tokens (this is room for any model's)."""

DERENDER_BATCH_ITEMS = 256
"""Stream chunks one derender batch call may carry."""
