"""vLLM's `POST /v1/messages/render`: an Anthropic Messages request, rendered as chat.

The request becomes the chat completion request `/v1/messages` makes of it
(`shared/anthropic_chat.py`), which chat render then renders: the same prompt and sampling, so
the answer is chat render's. System messages among the messages stay where they are unless the
chat template wants the system prompt first; then they join the leading system prompt. vLLM
decides that once per template, by rendering a probe conversation with a system message after
a user one (`system_first`): so does render, at start, so a request renders once.
"""

from __future__ import annotations

import jinja2
import jinja2.ext
import jinja2.sandbox
from aiohttp import web

import tokenline.services.render.app as render_app
from tokenline.shared.anthropic import MESSAGES_REQUEST
from tokenline.shared.anthropic_chat import chat_body
from tokenline.shared.http import read_json_body
from tokenline.shared.wire import JSON

PROBE = (
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
)


def system_first(template: str | None) -> bool:
    """Whether `template` refuses `PROBE` (or there is none), rendered as vLLM probes it: bare
    jinja, in a sandbox, without transformers' helpers, so a template that calls one (its
    `raise_exception` guard among them) counts as refusing."""
    if not template:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    try:
        env.from_string(template).render(messages=list(PROBE), add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


async def messages_render(request: web.Request) -> web.Response:
    anthropic = MESSAGES_REQUEST.decode(await read_json_body(request))
    merge = request.app[render_app.STATE].settings.system_first
    body = JSON.encode(chat_body(anthropic, merge_inline_system=merge))
    return await render_app.render_body(request, body, lambda state: state.chat)
