"""A model's tokenizer, chat template and generation defaults, without transformers or torch.

render and derender load models through this module only. It reads the files a Hugging Face
model directory carries (`tokenizer.json`, `tokenizer_config.json`, `generation_config.json`,
`config.json`) with the Rust `tokenizers` library and jinja2, which keeps those tiers' images
small and their start-up near a second (transformers imports torch).
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import normalizers

from tokenline.shared.errors import BadRequest

# OpenAI defaults for the sampling fields a generation config may override (vLLM's order).
SAMPLING_DEFAULTS: dict[str, float | int] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
_GENERATION_KEYS = (*SAMPLING_DEFAULTS, "max_new_tokens")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\.content|\[['\"]content['\"]\])")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers' override: jinja's own tojson escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# Compiled chat templates one tokenizer keeps: the model's own, and the request templates
# (--trust-request-chat-template) last used. Past it, the least recently used is dropped.
TEMPLATE_CACHE_SIZE = 16


class TemplateCache:
    """Compiled Jinja templates by source text, least recently used dropped past `size`.

    Only the source is the key: tools, messages and template kwargs are the context of each
    render, never part of a compiled template, so requests that differ in them share an entry
    safely. Thread-safe (render threads share it); a template compiles outside the lock."""

    def __init__(self, size: int = TEMPLATE_CACHE_SIZE) -> None:
        self.size = size
        self._env = _jinja_env()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, jinja2.Template] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, source: str) -> jinja2.Template:
        with self._lock:
            found = self._entries.get(source)
            if found is not None:
                self._entries.move_to_end(source)
                return found
        compiled = self._env.from_string(source)
        with self._lock:
            self._entries[source] = compiled
            self._entries.move_to_end(source)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return compiled


@dataclass
class ModelTokenizer:
    """Everything render and derender need to know about one model."""

    path: Path
    rust: RustTokenizer
    config: dict[str, Any]
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    chat_template: str | None
    templates: TemplateCache = field(default_factory=TemplateCache, repr=False)

    @classmethod
    def load(cls, path: str | Path, chat_template: str | None = None) -> ModelTokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok_cfg = _read_json(path / "tokenizer_config.json")
        template = chat_template or tok_cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return cls(
            path=path,
            rust=RustTokenizer.from_file(str(path / "tokenizer.json")),
            config=_read_json(path / "config.json"),
            tokenizer_config=tok_cfg,
            generation_config=_read_json(path / "generation_config.json"),
            chat_template=template if isinstance(template, str) else None,
        )

    # ------------------------------------------------------------------ vocabulary

    @cached_property
    def tokenizer_size(self) -> int:
        """IDs below this decode to text; the model's vocabulary may be larger (padding)."""
        return int(self.rust.get_vocab_size(with_added_tokens=True))

    @cached_property
    def vocab_size(self) -> int:
        """IDs at or above this crash an engine's embedding: nothing may send them."""
        return int(self.config.get("vocab_size") or self.tokenizer_size)

    @cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token can stand for (its byte-level form is
        at least as long as its text), so `max_model_len` tokens hold at most that many times
        this."""
        vocab = self.rust.get_vocab(with_added_tokens=True)
        return max(len(piece) for piece in vocab) if vocab else 1

    @cached_property
    def added_tokens(self) -> dict[int, str]:
        return {i: t.content for i, t in self.rust.get_added_tokens_decoder().items()}

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.rust.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def special_tokens_map(self) -> dict[str, str]:
        keys = ("bos_token", "eos_token", "unk_token", "pad_token")
        found = {k: _token_text(self.tokenizer_config.get(k)) for k in keys}
        return {k: v for k, v in found.items() if v is not None}

    @cached_property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens_map.get("eos_token")
        return None if eos is None else self.rust.token_to_id(eos)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS and the generation config's: generate stops on any of them."""
        gen = self.generation_config.get("eos_token_id")
        ids = set(gen if isinstance(gen, list) else [] if gen is None else [gen])
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(int(i) for i in ids)

    @cached_property
    def max_position_embeddings(self) -> int:
        return int(self.config.get("max_position_embeddings") or 2048)

    def generation_defaults(self) -> dict[str, Any]:
        """vLLM's `get_diff_sampling_param`: the generation config's sampling values, with
        `max_new_tokens` renamed `max_tokens`."""
        found = {
            k: self.generation_config[k]
            for k in _GENERATION_KEYS
            if self.generation_config.get(k) is not None
        }
        if "max_new_tokens" in found:
            found["max_tokens"] = found.pop("max_new_tokens")
        return found

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.encode_many([text], add_special_tokens)[0]

    def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's IDs, as `Tokenizer.encode` gives them. The batch call releases the GIL
        while Rust works (`encode` holds it: a long prompt stalled the event loop and the other
        render threads for milliseconds), and its fast form skips the offsets nobody reads."""
        rust = self.rust
        if self._without_nfc is not None and all(map(self._left_alone_by_nfc, texts)):
            rust = self._without_nfc
        encodings = rust.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    @cached_property
    def _without_nfc(self) -> RustTokenizer | None:
        """This tokenizer without its NFC normalizer, for texts NFC leaves as they are (most
        texts: NFC is what editors and browsers produce). Normalizing them anyway was ~18% of
        the instructions encoding a long prompt took (callgrind), and the result is the same.
        Render's CPU per request is ~6% lower for it: in `.venv/bin/python -m research.render`'s
        mix (tiny, concurrency 16), against the same code always encoding with the full
        tokenizer, interleaved in one run (ABBA, 24 blocks over three runs), +6.0% without it
        (paired difference, IQR +2.0%..+8.5%).

        None unless NFC is the whole normalizer and every added token is plain ASCII that
        strips nothing around it: the text is then cut around added tokens only before ASCII
        characters, where normalization never reaches across (see `_left_alone_by_nfc`)."""
        if not isinstance(self.rust.normalizer, normalizers.NFC):
            return None
        for token in self.rust.get_added_tokens_decoder().values():
            if not token.content.isascii() or token.lstrip or token.rstrip or token.single_word:
                return None
        twin = RustTokenizer.from_str(self.rust.to_str())
        twin.normalizer = None
        return twin

    @cached_property
    def _after_added_token(self) -> re.Pattern[str]:
        """An added token's last character followed by a non-ASCII one."""
        ends = {t.content[-1] for t in self.rust.get_added_tokens_decoder().values() if t.content}
        if not ends:
            return re.compile("(?!)")  # never matches
        return re.compile(f"[{re.escape(''.join(sorted(ends)))}](?=[^\\x00-\\x7f])")

    def _left_alone_by_nfc(self, text: str) -> bool:
        """The tokenizer normalizes each piece between added tokens on its own; NFC leaves
        every piece unchanged when the whole text is NFC and every cut falls before an ASCII
        character (ASCII starts a new normalization segment: no character composes with an
        earlier one across it, and none reorders past it). Python's Unicode tables are newer
        than the tokenizer's; tests check the verdict holds for every code point."""
        if text.isascii():
            return True
        return unicodedata.is_normalized("NFC", text) and not self._after_added_token.search(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.rust.decode(ids, skip_special_tokens=skip_special_tokens))

    def decode_one(self, token_id: int) -> str:
        """One token's text, as vLLM reports logprob tokens (`tokenizer.decode([id])`);
        decoded once per process (derender asks it for every logprob candidate)."""
        found = self._texts.get(token_id)
        if found is None:
            found = self._texts[token_id] = str(
                self.rust.decode([token_id], skip_special_tokens=False)
            )
        return found

    @cached_property
    def _texts(self) -> dict[int, str]:
        """`decode_one`'s cache, bounded by the vocabulary."""
        return {}

    # ------------------------------------------------------------------ chat template

    @cached_property
    def content_format(self) -> str:
        """ "openai" when the template iterates a message's content parts, else "string"."""
        return "openai" if _ITERATES_CONTENT.search(self.chat_template or "") else "string"

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template: str | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render like transformers' `apply_chat_template(tokenize=False)`."""
        source = template or self.chat_template
        if source is None:
            raise BadRequest(
                "this model has no chat template; pass --chat-template", param="messages"
            )
        final = ""
        if not _names_developer(source) and any(m["role"] == "developer" for m in messages):
            messages = _developer_as_system(messages)
        if continue_final_message:
            final, messages = _tag_final_message(messages, source)
        # The request's template kwargs override the defaults (`documents` among them), as
        # keys of one context: never a duplicate keyword argument.
        context = {"documents": None, **self.special_tokens_map, **(kwargs or {})}
        context |= {"messages": messages, "tools": tools}
        context["add_generation_prompt"] = add_generation_prompt
        rendered = self.templates.get(source).render(context)
        return _cut_at_tag(rendered, final) if continue_final_message else rendered


def _names_developer(source: str) -> bool:
    """The template knows the `developer` role (vLLM's test: the quoted name in its source)."""
    return '"developer"' in source or "'developer'" in source


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`developer` messages for a template that never names the role, as vLLM hands them to it:
    each becomes a system message (without `tools`), and when that leaves a system message
    anywhere but first, or more than one, all of them become one, first, their non-empty texts
    joined by blank lines (a template may demand its system message first)."""
    converted = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
        if m["role"] == "developer"
        else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems in ([], [0]):
        return converted
    texts = [_plain_text(converted[i].get("content")) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def _plain_text(content: Any) -> str:
    """A message's content as one string: its parts' texts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return content or ""


def _tag_final_message(
    messages: list[dict[str, Any]], source: str
) -> tuple[str, list[dict[str, Any]]]:
    """Mark the end of the final message so the render can be cut there (transformers' way)."""
    last = dict(messages[-1])
    final = last.get("content")
    if final is None or "content" not in source:
        raise BadRequest(
            "continue_final_message is set but the final message has no content to continue",
            param="continue_final_message",
        )
    if isinstance(final, list):
        parts = [dict(p) for p in final]
        texts = [p for p in parts if "text" in p]
        if not texts:
            raise BadRequest(
                "continue_final_message: no text to continue in the final message",
                param="continue_final_message",
            )
        final = texts[-1]["text"]
        texts[-1]["text"] = final + _CONTINUE_TAG
        last["content"] = parts
    else:
        last["content"] = final + _CONTINUE_TAG
    return str(final), [*messages[:-1], last]


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise BadRequest(
            "continue_final_message is set but the final message does not appear "
            "in the chat after applying the chat template",
            param="continue_final_message",
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()
