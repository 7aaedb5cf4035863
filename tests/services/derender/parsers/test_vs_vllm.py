"""Differential tests: our parsers against vLLM's own, in-process, on Qwen3-vocabulary outputs.

Every case is answered by vLLM's non-streaming path (`Parser.parse`, what a chat completion's
message carries) and by our chain fed token by token (then flushed), and whole; the two must
agree exactly: reasoning, content (`None` vs `""` too), tool-call names and arguments, for every
composition vLLM builds from `--reasoning-parser` and `--tool-call-parser`.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.services.derender.parsers.oracle import (
    COMBOS,
    Case,
    Vllm,
    flat,
    ours,
    per_token,
)
from tokenline.services.derender.parsers.adjust import ParserFlags
from tokenline.services.derender.parsing import ChatParsing
from tokenline.shared.tokenizer import ModelTokenizer
from tokenline.shared.wire import ChatCompletionRequest

H_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
H_CALL2 = '<tool_call>\n{"name": "search", "arguments": {"q": "日本語 ü 😀"}}\n</tool_call>'
X_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
X_TYPED = (
    "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
    '<parameter=metric>\nTrue\n</parameter>\n<parameter=where>\n{"lat": "1.5"}\n</parameter>\n'
    "<parameter=tags>\n[1, 2]\n</parameter>\n<parameter=unit>\nnull\n</parameter>\n"
    "<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>"
)
R = "<think>\nThe user wants weather.\n</think>\n\n"
OUTPUTS = {
    "empty": "",
    "plain": "Hello there, 世界!",
    "whitespace": "  \n ",
    "think": R + "Hello.",
    "think_no_open": "hmm\n</think>\n\nHello.",
    "think_unterminated": "<think>\nstill thinking about 😀",
    "think_empty": "<think></think>",
    "think_twice": R + "a</think>b<think>c",
    "special_token": R + "x<|im_end|>y<|endoftext|>",
    "hermes_call": R + H_CALL,
    "hermes_two_calls": R + "Sure.\n" + H_CALL + "\n" + H_CALL2,
    "hermes_bad_json": R + "<tool_call>\n{bad}\n</tool_call>",
    "hermes_good_then_bad": R + H_CALL + "\n<tool_call>{bad</tool_call>",
    "hermes_text_after": R + H_CALL + "\nafter text",
    "hermes_no_arguments": R + '<tool_call>{"name": "f"}</tool_call>',
    "hermes_unclosed": R + '<tool_call>{"name": "f", "arguments": {}}',
    "hermes_empty_call": R + "<tool_call></tool_call>",
    "xml_call": R + X_CALL,
    "xml_text_before": R + "Let me check.\n" + X_CALL + "\n",
    "xml_two_calls": R + X_CALL + "\n" + X_CALL.replace("Paris", "Rome"),
    "xml_text_after": R + X_CALL + "\nafter",
    "xml_truncated": R + X_CALL[:60],
    "xml_typed": R + X_TYPED,
    "xml_no_tool_call_wrapper": R
    + "<function=search>\n<parameter=q>\nx\n</parameter>\n</function>",
    "xml_json_body": R + '<tool_call>\n<function=>{"name": "search", "arguments": {"q": 1}}'
    "</function>\n</tool_call>",
    "xml_nameless": R + "<tool_call>\n<function=>\n</function>\n</tool_call> tail",
    "xml_think_in_content": R + "a</think>b" + X_CALL,
}


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}+{c[1]}")
@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_corpus_matches_vllm_whole(vllm: Vllm, combo: tuple[str | None, str | None], name: str):
    text = vllm.tok.decode(vllm.tok.encode(OUTPUTS[name], add_special_tokens=False))
    chunks = per_token(vllm.tok, text)
    for case in _cases(*combo):
        if (combo, name) in LEGACY_RAW and case.tool_choice != "none":
            continue  # test_legacy_pair_streams_content_raw
        expected = vllm.whole(case, text)
        assert ours(case, vllm.special_tokens, chunks) == expected, case
        assert ours(case, vllm.special_tokens, [([0] * len(chunks), text)]) == expected, case


LEGACY_RAW = {(("deepseek_r1", "qwen3_coder"), "xml_think_in_content")}


def test_legacy_pair_streams_content_raw(vllm: Vllm):
    """deepseek_r1 + qwen3_coder: vLLM drops `</think>` and special tokens from the content
    before a call only if some call stands, and keeps them otherwise; we stream them (kept)."""
    case = Case("deepseek_r1", "qwen3_coder")
    with_call, without = OUTPUTS["xml_think_in_content"], R + "a</think>b"
    assert vllm.whole(case, with_call)[1] == "ab"
    assert ours(case, vllm.special_tokens, per_token(vllm.tok, with_call))[1] == "a</think>b"
    assert vllm.whole(case, without)[1] == "\n\na</think>b"
    assert ours(case, vllm.special_tokens, per_token(vllm.tok, without))[1] == "\n\na</think>b"


COUNTED = {
    "tool_from_reasoning": 'Word. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "tool_then_think_end": "a b <tool_call>x</tool_call> c </think> d",
    "tool_text_then_end": "x <tool_call> y </think> z",
    "think_in_content": "a</think>b<think>c</think>d",
    "tool_end_in_reasoning": "a b </tool_call> c",
    "tool_end_then_end": "a </tool_call> b </think> c </tool_call> d",
    "specials_in_reasoning": "a <|im_end|> b <|endoftext|> c <|im_start|> d",
    "think_start_in_reasoning": "a <think> b </think> c",
    "tool_response_in_reasoning": "a <tool_response> b </tool_response> c",
}
"""Outputs for the reasoning-token count besides the corpus: tags and special tokens inside
reasoning (qwen3's engine counts none of them, and `<tool_call>` ends reasoning)."""


@pytest.mark.parametrize("combo", [c for c in COMBOS if c[0]], ids=lambda c: f"{c[0]}+{c[1]}")
def test_reasoning_token_counts_match_vllm(
    vllm: Vllm, qwen3_tok: ModelTokenizer, combo: tuple[str, str | None]
) -> None:
    """`completion_tokens_details.reasoning_tokens` as vLLM counts it, thinking on and off
    (qwen3's count once differed from vLLM's: see `COUNTED`)."""
    reasoning, tool = combo
    flags = ParserFlags(tool is not None, tool, reasoning)
    for name, text in (OUTPUTS | COUNTED).items():
        ids = vllm.tok.encode(text, add_special_tokens=False)
        for thinking in (True, False):
            case = Case(reasoning, tool, enable_thinking=thinking)
            body = {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": case.tools,
                "chat_template_kwargs": {"enable_thinking": thinking},
            }
            parsing = ChatParsing.of(flags, msgspec.convert(body, ChatCompletionRequest), qwen3_tok)
            assert parsing is not None
            ours = parsing.reasoning_tokens(ids, hidden_last=False)
            assert ours == vllm.reasoning_tokens(case, ids), (name, thinking)


def _cases(reasoning: str | None, tool: str | None) -> list[Case]:
    cases = [Case(reasoning, tool), Case(reasoning, tool, enable_thinking=False)]
    if tool is not None:
        cases += [
            Case(reasoning, tool, tool_choice="none"),
            Case(reasoning, tool, tool_choice="required"),
            Case(reasoning, tool, tools=None),
        ]
    return cases


# vLLM's streaming answer (deltas joined) differs from its own non-streaming answer here; ours
# streams the non-streaming answer. The streamed value is asserted so this list stays true.
STREAMING_DIFFERS = [
    # hermes streams calls as they come: a later bad call cannot take the first one back.
    ("qwen3", "hermes", "hermes_good_then_bad", ("\nThe user wants weather.\n", "\n\n", 1)),
    # hermes streams no markup as content, so a bad call vanishes instead of becoming content.
    ("qwen3", "hermes", "hermes_bad_json", ("\nThe user wants weather.\n", "\n\n", 0)),
    # hermes streams the whitespace before a call, which the whole answer drops.
    ("qwen3", "hermes", "hermes_call", ("\nThe user wants weather.\n", "\n\n", 1)),
    # the engine streams content unstripped, and text after a call as content.
    ("qwen3", "qwen3_coder", "xml_text_before", ("\nThe user wants weather.\n", None, 1)),
    ("qwen3", "qwen3_coder", "xml_text_after", ("\nThe user wants weather.\n", "after", 1)),
    # a truncated call streams its partial arguments; the whole answer has none.
    ("qwen3", "qwen3_coder", "xml_truncated", ("\nThe user wants weather.\n", None, 1)),
    # deepseek_r1 streams text before a late `<think>` as reasoning; the whole answer drops it.
    ("deepseek_r1", None, "ds_text_before_think", ("intro r", "c", 0)),
]


@pytest.mark.parametrize(("reasoning", "tool", "name", "streamed"), STREAMING_DIFFERS)
def test_we_stream_the_whole_answer_where_vllm_streaming_differs(
    vllm: Vllm,
    reasoning: str | None,
    tool: str | None,
    name: str,
    streamed: tuple[str | None, str | None, int],
):
    text = {**OUTPUTS, "ds_text_before_think": "intro <think>r</think>c"}[name]
    case, chunks = Case(reasoning, tool), per_token(vllm.tok, text)
    whole, theirs = vllm.whole(case, text), vllm.streamed(case, chunks)
    assert flat(theirs) != flat(whole)
    if streamed[1] is not None:
        assert theirs[:2] == streamed[:2]
    assert theirs[0] == streamed[0] and len(theirs[2]) == streamed[2]
    assert ours(case, vllm.special_tokens, chunks) == whole


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}+{c[1]}")
@pytest.mark.parametrize(
    "name", ["plain", "think", "think_unterminated", "xml_call", "hermes_two_calls"]
)
def test_where_vllm_streaming_agrees_we_agree_with_it(
    vllm: Vllm, combo: tuple[str | None, str | None], name: str
):
    case, chunks = Case(*combo), per_token(vllm.tok, OUTPUTS[name])
    whole, streamed = vllm.whole(case, OUTPUTS[name]), vllm.streamed(case, chunks)
    if flat(streamed) == flat(whole):
        assert flat(ours(case, vllm.special_tokens, chunks)) == flat(streamed)


FRAGMENTS = [
    *("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>"),
    *("<parameter=", "</parameter>", ">", "<", "</", "<tool_", "<think", "\n", "\n\n", " "),
    *("get_weather", "city", "days", "metric", "search", "name", "x", "5", "true", "null"),
    *("Paris", "é😀", "{", "}", '"', ":", ",", '{"name": "get_weather", "arguments": {"days": 1}}'),
    *('"name": "search"', '{"a": 1}', "<|im_end|>", "<|endoftext|>", "<|im_start|>", "\\"),
    *("[1]", " parameter", "=", '"arguments": ', "1.5", "-3", "[", "]"),
]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fragments=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
    combo=st.sampled_from(COMBOS),
    tool_choice=st.sampled_from(["auto", "none", "required"]),
    thinking=st.booleans(),
    step=st.integers(1, 6),
)
def test_markup_soup_matches_vllm_whole(
    vllm: Vllm,
    fragments: list[str],
    combo: tuple[str | None, str | None],
    tool_choice: str,
    thinking: bool,
    step: int,
):
    text = "".join(fragments)
    late_think = combo[0] == "deepseek_r1" and text.find("<think>") >= 32
    legacy_drop = combo == ("deepseek_r1", "qwen3_coder") and (
        "<|" in text or text.count("</think>") > 1
    )
    if late_think or legacy_drop:
        return  # the two documented divergences: deepseek_r1's window, the legacy pair's drops
    case = Case(*combo, tool_choice=tool_choice, enable_thinking=thinking)
    chunks = [([0], text[i : i + step]) for i in range(0, len(text), step)]
    assert ours(case, vllm.special_tokens, chunks) == vllm.whole(case, text)


# Where exactness would need an unbounded hold, we commit after a documented bound; each case
# pins both answers so the documentation stays true.
LONG = "word " * 60
DIVERGENCES = [
    # qwen3_coder: content starting with whitespace waits `content_lookahead` (256) characters.
    ("qwen3", "qwen3_coder", R + LONG + X_CALL, LONG.strip(), "\n\n" + LONG.rstrip()),
    # hermes: whitespace-only content waits as long, then is sent though a call follows.
    (None, "hermes", " " * 300 + H_CALL, None, " " * 300),
    # deepseek_r1: a `<think>` starting 32 characters or more into the output is text.
    ("deepseek_r1", None, "x" * 40 + "<think>r</think>c", "c", "c"),
    # a JSON `name` that is not a string: vLLM fails the request, for us it is no call.
    (
        None,
        "qwen3_coder",
        '<tool_call>\n<function= >{"name": 5, "arguments": {}}</function>',
        None,
        None,
    ),
]


@pytest.mark.parametrize(("reasoning", "tool", "text", "vllm_content", "our_content"), DIVERGENCES)
def test_documented_divergences(
    vllm: Vllm,
    reasoning: str | None,
    tool: str | None,
    text: str,
    vllm_content: str | None,
    our_content: str | None,
):
    case, chunks = Case(reasoning, tool), per_token(vllm.tok, text)
    mine = ours(case, vllm.special_tokens, chunks)
    assert mine[1] == our_content
    assert mine == ours(case, vllm.special_tokens, [([0], text)])
    try:
        theirs = vllm.whole(case, text)
    except Exception:  # the non-string name
        assert mine[2] == []
        return
    assert theirs[1] == vllm_content and theirs != mine


WS = st.sampled_from(["", "\n", "\n\n", " ", "  \n"])
XML_PARAM = st.builds(
    "<parameter={}>{}{}{}</parameter>{}".format,
    st.sampled_from(["city", "days", "metric", "where", "tags", "unit", "q"]),
    WS,
    st.sampled_from(["Paris", "3", "true", "x y", '{"lat": "2"}', '[1, "2"]', "null", "é", "1.50"]),
    WS,
    WS,
)
XML = st.builds(
    "<tool_call>{}<function={}>{}{}</function>{}</tool_call>".format,
    WS,
    st.sampled_from(["get_weather", "search", ""]),
    WS,
    st.lists(XML_PARAM, max_size=3).map("".join),
    WS,
)
HERMES = st.builds(
    "<tool_call>{}{}{}</tool_call>".format,
    WS,
    st.sampled_from(
        [
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}',
            '{"name": "search", "arguments": {}}',
            *('{"name": "search"}', "{bad", "[]", '{"name": 1, "arguments": 2}'),
        ]
    ),
    WS,
)


@st.composite
def _damaged(draw: st.DrawFn, call: str) -> str:
    """A call with, sometimes, a slice replaced by stray markup (truncation, lost closers)."""
    if not draw(st.integers(0, 3)) or not call:
        i = draw(st.integers(0, len(call)))
        j = draw(st.integers(i, min(len(call), i + 12)))
        stray = draw(st.sampled_from(["", "<", ">", "</", "<|im_end|>", "<tool_call>"]))
        return call[:i] + stray + call[j:]
    return call


ANSWERS = st.builds(
    "{}{}{}{}{}".format,
    st.sampled_from(["", "<think>\nreasoning é\n</think>", "reasoning\n</think>", "<think>x"]),
    WS,
    st.sampled_from(["", "Sure.", "Let me check the weather for you."]),
    st.lists((XML | HERMES).flatmap(_damaged).map(lambda c: c + "\n"), max_size=3).map("".join),
    st.sampled_from(["", "after", "<|im_end|>", "</think>x"]),
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    text=ANSWERS,
    combo=st.sampled_from(COMBOS),
    tool_choice=st.sampled_from(["auto", "none", "required"]),
    thinking=st.booleans(),
)
# found by Hypothesis: a forced choice whose answer is whitespace and a special token is content
@example(text="\n<|im_end|>", combo=(None, "qwen3_coder"), tool_choice="required", thinking=False)
def test_damaged_tool_calls_match_vllm_whole(
    vllm: Vllm, text: str, combo: tuple[str | None, str | None], tool_choice: str, thinking: bool
):
    if combo == ("deepseek_r1", "qwen3_coder") and ("<|" in text or "</think>x" in text):
        return  # the legacy pair's documented divergence
    text = vllm.tok.decode(vllm.tok.encode(text, add_special_tokens=False))
    case = Case(*combo, tool_choice=tool_choice, enable_thinking=thinking)
    try:
        expected = vllm.whole(case, text)
    except ValueError:
        return  # vLLM fails the request on a call whose JSON name is not a string
    assert ours(case, vllm.special_tokens, per_token(vllm.tok, text)) == expected
