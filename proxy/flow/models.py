"""Which pools serve a request: the model it names, or the base model of the adapter it names.

Every served model has its own four pools (`Hops`); render and derender replicas each serve one
model, as vLLM's do. A request names a served model, a LoRA adapter one of them serves, or
nothing (the first model). An adapter's request goes to its base model's pools and is rendered
and derendered as the base model's: vLLM's render knows no adapters (its model registry has
none), and an adapter shares its base model's tokenizer and template. Only the engine hears the
adapter's name, and the client sees it in every answer's `model`, as monolithic vLLM shows it.

What adapters each model serves, the proxy learns from its generate engines' `/v1/models`
(vLLM lists an adapter with its base model as `parent` and its path as `root`), on every upkeep
round and after each load or unload through the proxy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenline.proxy.flow.hops import Hops
from tokenline.shared.errors import NotFound
from tokenline.shared.served import served_name
from tokenline.shared.wire import JSON, GenerateRequest


class ModelCard(msgspec.Struct, kw_only=True):
    """What the proxy reads of an entry of vLLM's `/v1/models`."""

    id: str
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]


MODEL_LIST = msgspec.json.Decoder(ModelList)


@dataclass
class ServedPools:
    """One served model's pools, and what its engines say they serve."""

    name: str | None
    """Its served name (None: the one model of the replica flags, named by its engines)."""
    hops: Hops
    bases: tuple[str, ...] = ()
    """The base model's names, as its engines list them."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapter name -> its path, as its engines list them (shared with cache-aware routing,
    which keys an adapter's blocks by both, as vLLM does)."""
    loaded: dict[str, bytes] = field(default_factory=dict)
    """Adapters loaded through the proxy: name -> the load request, for replicas that lack
    them (restarted, or joined later)."""

    def names(self) -> tuple[str, ...]:
        return (self.name,) if self.name is not None else self.bases

    def learned(self, cards: Sequence[ModelCard]) -> None:
        """What an engine of this model lists (`/v1/models`)."""
        self.bases = tuple(c.id for c in cards if c.parent is None)
        fresh = {c.id: c.root or "" for c in cards if c.parent is not None}
        if fresh != self.adapters:
            self.adapters.clear()
            self.adapters.update(fresh)


@dataclass(frozen=True)
class Target:
    """Where a request goes: the pools that serve it and, for an adapter, its name."""

    served: ServedPools
    adapter: str | None = None
    base: str = ""
    """An adapter's base model, under the name render and derender serve it as."""

    @property
    def hops(self) -> Hops:
        return self.served.hops

    def as_base(self, raw: bytes) -> bytes:
        """The client's request as render and derender see it: naming the base model."""
        if self.adapter is None:
            return raw
        body: dict[str, Any] = msgspec.json.decode(raw)
        body["model"] = self.base
        return JSON.encode(body)

    def to_engine(self, gens: list[GenerateRequest]) -> list[GenerateRequest]:
        """Render's requests as the engine must run them: with the adapter."""
        if self.adapter is None:
            return gens
        return [msgspec.structs.replace(g, model=self.adapter) for g in gens]

    def renamed(self, data: bytes) -> bytes:
        """Answer bytes (JSON, or SSE events of JSON) naming the adapter where derender named
        its base model. Exact: inside a JSON string every quote is escaped, so the unescaped
        `"model":"<base>"` can only be a `model` member, and no other member of an answer is
        called `model`."""
        if self.adapter is None:
            return data
        return data.replace(self._member(self.base), self._member(self.adapter))

    @staticmethod
    def _member(name: str) -> bytes:
        return b'"model":' + JSON.encode(name)


@dataclass
class Models:
    """Every served model's pools; the first is the default."""

    served: list[ServedPools]

    def target(self, requested: str | None) -> Target:
        """The pools for `requested`; NotFound (vLLM's 404) for a name nothing serves."""
        if not requested:
            return Target(self.served[0])
        for served in self.served:
            if requested in served.names():
                return Target(served)
        for served in self.served:
            if requested in served.adapters:
                base = served.name if served.name is not None else served.bases[0]
                return Target(served, requested, base)
        if len(self.served) == 1 and self.served[0].name is None:
            return Target(self.served[0])  # its render replicas name the fault
        names = tuple(n for s in self.served for n in s.names())
        served_name(requested, names)
        raise NotFound(f"The model `{requested}` does not exist.", param="model")  # no names

    def of_model(self, name: str) -> ServedPools:
        for served in self.served:
            if name in served.names():
                return served
        raise NotFound(f"The model `{name}` does not exist.", param="model")
