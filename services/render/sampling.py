"""Sampling parameters as vLLM derives them from an OpenAI request (pure).

Priority per field: the request's value, then the model's generation config, then OpenAI's
default. `max_tokens` is always explicit. Values that would crash or wedge an engine (IDs outside
the vocabulary, budgets beyond the context) are refused here, before generate sees them.
"""

from __future__ import annotations

from typing import Any

from tokenline.shared.errors import BadRequest
from tokenline.shared.limits import MAX_LOGPROBS
from tokenline.shared.served import stop_list
from tokenline.shared.tokenizer import SAMPLING_DEFAULTS, ModelTokenizer
from tokenline.shared.wire import ChatCompletionRequest, CompletionRequest, SamplingParams

OUTPUT_DELTA, OUTPUT_FINAL_ONLY = 1, 2


def max_tokens_for(
    requested: int | None,
    param: str,
    prompt_len: int,
    max_model_len: int,
    defaults: dict[str, Any],
) -> int:
    """vLLM's `get_max_tokens` plus the bounds its tokenize step checks."""
    if requested is not None and requested > max_model_len:
        raise BadRequest(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens.",
            param=param,
        )
    if prompt_len >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {prompt_len} input tokens, which leaves no room for output "
            f"tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )
    fallback = requested if requested is not None else defaults.get("max_tokens")
    budget = max_model_len - prompt_len
    return min(budget, fallback) if fallback is not None else budget


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """A tokens-only engine indexes its embedding with these: one bad ID kills it."""
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise BadRequest(
                f"Token ID {token_id} at position {i} is out of vocabulary "
                f"(vocab_size={vocab_size}).",
                param=param,
            )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if raw is None:
        return None
    try:
        bias = {int(k): float(v) for k, v in raw.items()}
    except ValueError as exc:
        raise BadRequest(f"logit_bias keys must be token IDs: {exc}", param="logit_bias") from exc
    check_token_ids([k for k in bias if k >= 0], vocab_size, "logit_bias")
    if any(k < 0 for k in bias):
        raise BadRequest("logit_bias keys must be non-negative token IDs", param="logit_bias")
    return bias


SHARED_XARGS = ("kv_cache_report_mode",)
"""`vllm_xargs` keys a request may not set: "full" makes the engine publish every block it
reuses as newly stored, which corrupts the KV events every other request is routed by."""


def _checked_xargs(xargs: dict[str, object] | None) -> dict[str, object] | None:
    for key in SHARED_XARGS:
        if xargs and key in xargs:
            raise BadRequest(
                f"vllm_xargs.{key} is not accepted: the engines' KV events are shared by every "
                "request's routing",
                param=f"vllm_xargs.{key}",
            )
    return xargs or None


def _check_values(params: SamplingParams) -> None:
    if params.n > 1 and params.temperature < 1e-5:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {params.n}.", param="n")
    if params.top_k < -1:
        raise BadRequest(
            f"top_k must be 0 (disable), or at least 1, got {params.top_k}.", param="top_k"
        )
    max_tokens = params.max_tokens
    if isinstance(max_tokens, int) and params.min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {params.min_tokens}.",
            param="min_tokens",
        )
    for name, asked in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
        if asked is not None and asked > MAX_LOGPROBS:
            raise BadRequest(
                f"Requested {name} logprobs of {asked}, which is greater "
                f"than max allowed: {MAX_LOGPROBS}",
                param="logprobs" if name == "sample" else "prompt_logprobs",
            )


def _chosen(
    request: ChatCompletionRequest | CompletionRequest, defaults: dict[str, Any]
) -> dict[str, Any]:
    return {
        name: value
        if (value := getattr(request, name)) is not None
        else defaults.get(name, default)
        for name, default in SAMPLING_DEFAULTS.items()
    }


def prompt_logprobs_of(
    request: ChatCompletionRequest | CompletionRequest, logprobs: int | None
) -> int | None:
    """vLLM's rule: the request's `prompt_logprobs`, else with `echo` the output's logprobs
    count; never with a stream (a generate stream does not carry them)."""
    asked = request.prompt_logprobs
    if request.stream and asked is not None and (asked > 0 or asked == -1):
        raise BadRequest(
            "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
        )
    if asked is None and request.echo:
        return logprobs
    return asked


def thinking_budget(value: Any) -> int | None:
    """vLLM's `validate_thinking_token_budget`: a non-negative int caps the reasoning tokens
    (the engine counts and ends them, with its reasoning parser), -1 and null cap nothing."""
    if value is None:
        return None
    if type(value) is not int or value < -1:
        raise BadRequest(
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
            param="thinking_token_budget",
        )
    return None if value == -1 else value


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    constraint: dict[str, Any] | None,
    tok: ModelTokenizer,
) -> SamplingParams:
    """The generate-side `SamplingParams` for `request` (validated)."""
    defaults = tok.generation_defaults()
    chosen = _chosen(request, defaults)
    if chosen["temperature"] < 1e-5:  # greedy: vLLM neutralises the truncation knobs
        chosen |= {"top_p": 1.0, "top_k": 0, "min_p": 0.0}
    for name in ("stop_token_ids", "allowed_token_ids"):
        check_token_ids(getattr(request, name) or [], tok.vocab_size, name)
    params = SamplingParams(
        n=request.n,
        **chosen,
        seed=None if request.seed == -1 else request.seed,
        stop=stop_list(request.stop) or None,
        stop_token_ids=request.stop_token_ids or None,
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logit_bias=_logit_bias(request.logit_bias, tok.vocab_size),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words or None,
        structured_outputs=constraint,
        extra_args=_checked_xargs(request.vllm_xargs),
        output_kind=OUTPUT_DELTA if request.stream else OUTPUT_FINAL_ONLY,
        skip_clone=True,
        thinking_token_budget=thinking_budget(request.thinking_token_budget),
    )
    _check_values(params)
    return params
