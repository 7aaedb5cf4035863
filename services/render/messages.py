"""vLLM's `POST /v1/messages/render`: an Anthropic Messages request, rendered as chat.

The request becomes the chat completion request `/v1/messages` makes of it
(`shared/anthropic_chat.py`), which chat render then renders: the same prompt and sampling, so
the answer is chat render's. System messages among the messages stay where they are unless the
chat template refuses them there; then they join the leading system prompt, as vLLM merges them
for a template that wants the system prompt first (vLLM decides by rendering a probe
conversation once; here the request's own conversation decides, which is the same for
templates that refuse any system message but the first).
"""

from __future__ import annotations

from aiohttp import web

import tokenline.services.render.app as render_app
from tokenline.shared.anthropic import MESSAGES_REQUEST, MessagesRequest
from tokenline.shared.anthropic_chat import chat_body
from tokenline.shared.errors import BadRequest
from tokenline.shared.http import read_json_body
from tokenline.shared.wire import JSON

TEMPLATE_ERROR = "chat template error"
"""How chat render's refusal of a conversation by the template begins (`render/chat.py`)."""


async def messages_render(request: web.Request) -> web.Response:
    anthropic = MESSAGES_REQUEST.decode(await read_json_body(request))
    try:
        return await _render(request, anthropic, merge=False)
    except BadRequest as exc:
        if not (exc.message.startswith(TEMPLATE_ERROR) and inline_system(anthropic)):
            raise
    return await _render(request, anthropic, merge=True)


async def _render(request: web.Request, anthropic: MessagesRequest, merge: bool) -> web.Response:
    body = JSON.encode(chat_body(anthropic, merge_inline_system=merge))
    return await render_app.render_body(request, body, lambda state: state.chat)


def inline_system(anthropic: MessagesRequest) -> bool:
    """The request has system messages among its messages."""
    return any(msg.role == "system" for msg in anthropic.messages)
