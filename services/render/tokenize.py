"""`POST /tokenize`: a prompt or a conversation as token IDs, as vLLM answers it (pure).

The chat form goes through render's own templating (`chat_prompt`), so `/tokenize` counts
exactly the tokens `/v1/chat/completions/render` would send. Unlike render, vLLM bounds neither
form by `max_model_len` (counting a long text is what the route is for), and neither does this.
"""

from __future__ import annotations

from tokenline.services.render import worker
from tokenline.services.render.chat import chat_prompt, refuse_media_kwargs
from tokenline.services.render.render import RenderSettings, check_model
from tokenline.shared.errors import BadRequest
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import (
    JSON,
    TOKENIZE_REQUEST,
    ChatCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
)


def _as_chat_request(request: TokenizeRequest) -> ChatCompletionRequest:
    """The templating fields of a chat completion request. /tokenize never chooses a tool, so
    its tools reach the template as with `tool_choice: "none"`."""
    return ChatCompletionRequest(
        messages=request.messages or [],
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template=request.chat_template,
        chat_template_kwargs=request.chat_template_kwargs,
        tools=request.tools,
        tool_choice="none",
    )


def _chat_ids(request: TokenizeRequest, tok: ModelTokenizer, settings: RenderSettings) -> list[int]:
    if not request.messages:
        raise BadRequest(
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
            param="messages",
        )
    refuse_media_kwargs(request)
    prompt = chat_prompt(_as_chat_request(request), tok, settings)
    return tok.encode(prompt, add_special_tokens=request.add_special_tokens is True)


def tokenize(
    request: TokenizeRequest, tok: ModelTokenizer, settings: RenderSettings
) -> TokenizeResponse:
    """vLLM's `create_tokenize`: the model checked, then the chat or prompt form tokenized."""
    check_model(request.model, settings)
    if request.is_chat():
        ids = _chat_ids(request, tok, settings)
    elif request.prompt is not None:
        ids = tok.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
    else:
        raise BadRequest(
            "Field required: `prompt` (a string) or `messages` (a list of messages).",
            param="prompt",
        )
    strs = [str(tok.rust.id_to_token(i)) for i in ids] if request.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=settings.max_model_len, tokens=ids, token_strs=strs
    )


def tokenize_body(renderer: worker.Renderer, body: bytes) -> bytes:
    """A `/tokenize` body to its answer, on a renderer's tokenizer (bytes both ways, so a
    process pool moves only the body)."""
    return JSON.encode(tokenize(TOKENIZE_REQUEST.decode(body), renderer.tok, renderer.settings))


def process_tokenize(body: bytes) -> bytes:
    """`tokenize_body` in a render worker process, on the renderer its pool set up."""
    return tokenize_body(worker._PROCESS_RENDERER[0], body)
