"""vLLM's `POST /v1/responses/render`: a Responses request, rendered as chat, stateless.

The request becomes the chat completion request `/v1/responses` makes of it
(`shared/responses_chat.py`), which chat render renders: the same prompt and sampling. As in
vLLM, render keeps no responses: `previous_response_id` is refused, and the answer's
`request_id` is a fresh `resp_` id.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

import tokenline.services.render.app as render_app
from tokenline.shared.errors import BadRequest
from tokenline.shared.http import read_json_body
from tokenline.shared.responses import JSON, RESPONSES_REQUEST
from tokenline.shared.responses_chat import chat_request, input_items, new_id


async def responses_render(request: web.Request) -> web.Response:
    asked = RESPONSES_REQUEST.decode(await read_json_body(request))
    if asked.previous_response_id is not None:
        raise BadRequest(
            "previous_response_id is not supported by the stateless render endpoint.",
            param="previous_response_id",
        )
    body = JSON.encode(chat_request(asked, input_items(asked.input)))
    rendered = await render_app.render_body(request, body, lambda state: state.chat)
    assert isinstance(rendered.body, bytes)
    generate = msgspec.json.decode(rendered.body)
    generate["request_id"] = new_id("resp")
    return web.Response(body=JSON.encode(generate), content_type="application/json")
