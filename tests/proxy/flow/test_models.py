"""Which pools serve a request: models by name, adapters by their base model's pools."""

from __future__ import annotations

from typing import Any, cast

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenline.proxy.flow.hops import Hops
from tokenline.proxy.flow.models import ModelCard, Models, ServedPools
from tokenline.shared.errors import NotFound
from tokenline.shared.wire import JSON, GenerateRequest, SamplingParams


def served(name: str | None, adapters: dict[str, str] | None = None) -> ServedPools:
    pools = ServedPools(name, cast(Hops, object()))
    cards = [ModelCard(id=name or "engine-name")]
    cards += [
        ModelCard(id=a, root=p, parent=name or "engine-name") for a, p in (adapters or {}).items()
    ]
    pools.learned(cards)
    return pools


def test_a_named_model_and_the_default() -> None:
    chat, coder = served("chat"), served("coder")
    models = Models([chat, coder])
    assert models.target("coder").served is coder
    assert models.target(None).served is chat and models.target("").served is chat


def test_an_unknown_model_is_vllms_404() -> None:
    models = Models([served("chat", {"a1": "/a1"}), served("coder")])
    with pytest.raises(NotFound) as caught:
        models.target("x" * 10_000)
    assert caught.value.param == "model"
    assert caught.value.message == (
        f"The model `{'x' * 10_000}` does not exist. Valid aliases: chat, coder."
    )


def test_an_adapter_goes_to_its_base_models_pools() -> None:
    chat, coder = served("chat"), served("coder", {"sql": "/loras/sql"})
    target = Models([chat, coder]).target("sql")
    assert target.served is coder and (target.adapter, target.base) == ("sql", "coder")


def test_the_unnamed_model_takes_its_names_from_its_engines() -> None:
    one = served(None, {"a1": "/a1"})
    models = Models([one])
    assert models.target("engine-name").adapter is None
    assert (models.target("a1").adapter, models.target("a1").base) == ("a1", "engine-name")
    # a name its engines do not list: its render replicas answer (vLLM's 404, with its names)
    assert models.target("other").served is one and models.target("other").adapter is None


def test_learning_keeps_the_adapter_table_shared_with_routing() -> None:
    one = served("chat", {"a1": "/a1"})
    table = one.adapters
    one.learned([ModelCard(id="chat"), ModelCard(id="a2", root="/a2", parent="chat")])
    assert table is one.adapters and table == {"a2": "/a2"}


def test_render_and_derender_see_the_base_model_the_engine_the_adapter() -> None:
    target = Models([served("chat", {"a1": "/a1"})]).target("a1")
    raw = JSON.encode({"model": "a1", "messages": [{"role": "user", "content": "hi"}]})
    assert msgspec.json.decode(target.as_base(raw))["model"] == "chat"
    gen = GenerateRequest(token_ids=[1, 2], sampling_params=SamplingParams(), model="chat")
    assert [g.model for g in target.to_engine([gen])] == ["a1"]


json_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text().filter(lambda k: k != "model"), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(content=json_text, base=st.text(min_size=1), adapter=st.text(min_size=1))
def test_renaming_changes_the_model_member_and_nothing_else(
    content: Any, base: str, adapter: str
) -> None:
    target = Models([served(base, {adapter: "/p"})]).target(adapter)
    if target.adapter is None:  # the adapter's name is the base model's
        return
    answer = {"id": "x", "model": base, "choices": [{"text": content, "model": base}]}
    renamed = msgspec.json.decode(target.renamed(JSON.encode(answer)))
    # nested `model` members are renamed too: no answer of an OpenAI API has one but the top
    assert renamed == answer | {
        "model": adapter,
        "choices": [{"text": content, "model": adapter}],
    }
    events = b"data: " + JSON.encode(answer) + b"\n\ndata: [DONE]\n\n"
    assert target.renamed(events).count(JSON.encode(adapter)) >= 1


def test_an_answer_of_an_unnamed_request_is_left_as_it_is() -> None:
    target = Models([served("chat")]).target("chat")
    data = b'{"model":"chat"}'
    assert target.renamed(data) is data and target.as_base(data) is data
