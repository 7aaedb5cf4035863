"""Render work that runs off the event loop: in a thread, or in worker processes.

The functions take and return bytes, so a process pool moves only the body across.
A process pool's workers each hold one `Renderer`, set by the pool's initializer: that
per-process slot is the one module-level state here, owned by the pool that created it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.services.render.render import RenderSettings, render_chat, render_completion
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import CHAT_REQUEST, COMPLETION_REQUEST, JSON


@dataclass
class Rendered:
    body: bytes
    prompt_tokens: int


@dataclass
class Renderer:
    tok: ModelTokenizer
    settings: RenderSettings

    def chat(self, body: bytes, request_id: str | None) -> Rendered:
        out = render_chat(CHAT_REQUEST.decode(body), self.tok, self.settings, request_id)
        return Rendered(JSON.encode(out), len(out.token_ids))

    def completion(self, body: bytes, request_id: str | None) -> Rendered:
        outs = render_completion(
            COMPLETION_REQUEST.decode(body), self.tok, self.settings, request_id
        )
        return Rendered(JSON.encode(outs), sum(len(o.token_ids) for o in outs))


_PROCESS_RENDERER: list[Renderer] = []


def init_process(model: str, chat_template: str | None, settings: RenderSettings) -> None:
    _PROCESS_RENDERER[:] = [Renderer(ModelTokenizer.load(model, chat_template), settings)]


def process_chat(body: bytes, request_id: str | None) -> Rendered:
    return _PROCESS_RENDERER[0].chat(body, request_id)


def process_completion(body: bytes, request_id: str | None) -> Rendered:
    return _PROCESS_RENDERER[0].completion(body, request_id)


def process_ready() -> int:
    return len(_PROCESS_RENDERER)
