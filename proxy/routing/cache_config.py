"""What an engine's `/metrics` says about its prefix cache, and one answer per pool.

vLLM publishes its `CacheConfig` as the labels of one gauge, `vllm:cache_config_info` (one
sample per engine of a data-parallel server). The proxy reads block size, hash algorithm and
whether prefix caching is on from it when a replica joins: hashes computed with another block
size or algorithm never match, so replicas of one pool that disagree are a configuration error
the proxy reports, not a cache that silently never hits.

What it cannot show is the hash seed (`PYTHONHASHSEED`, see `prefix.py`): a KV-event check
(`kv_events.check_hashes`) catches that one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from tokenline.proxy.routing.prefix import HASH_ALGOS, HashAlgo

METRIC = "vllm:cache_config_info"
_SAMPLE = re.compile(r"^vllm:cache_config_info\{(?P<labels>.*)\}\s+\S+", re.MULTILINE)
_LABEL = re.compile(r'(?P<name>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"\s*,?\s*')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class CacheConfigError(ValueError):
    """An engine's cache configuration is missing, unreadable, or disagrees with its pool's."""


class EngineCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What prefix routing needs to know about one engine's cache."""

    block_size: int
    """Tokens per block hash (vLLM's `hash_block_size` where set, else `block_size`)."""
    hash_algo: HashAlgo
    prefix_caching: bool


def parse_labels(text: str) -> dict[str, str]:
    """Prometheus label pairs `a="x",b="y"` (values unescaped)."""
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise CacheConfigError(f"unreadable labels at {text[pos : pos + 40]!r}")
        value = re.sub(r"\\.", lambda m: _UNESCAPE.get(m.group(), m.group()), match["value"])
        labels[match["name"]] = value
        pos = match.end()
    return labels


def parse_cache_config(metrics: str) -> EngineCacheConfig:
    """The cache configuration in an engine's `/metrics` text (every engine of a
    data-parallel server must agree)."""
    found = {_from_labels(parse_labels(m["labels"])) for m in _SAMPLE.finditer(metrics)}
    if not found:
        raise CacheConfigError(f"no {METRIC} in the metrics (not a vLLM engine?)")
    if len(found) > 1:
        raise CacheConfigError(f"the engines of one server disagree: {sorted(map(str, found))}")
    return found.pop()


def _from_labels(labels: Mapping[str, str]) -> EngineCacheConfig:
    try:
        size = labels.get("hash_block_size", "None")
        block_size = int(labels["block_size"] if size == "None" else size)
        algo = labels["prefix_caching_hash_algo"]
        caching = labels["enable_prefix_caching"]
    except (KeyError, ValueError) as exc:
        raise CacheConfigError(f"{METRIC} lacks a readable {exc}") from exc
    if algo not in HASH_ALGOS:
        raise CacheConfigError(f"unknown prefix_caching_hash_algo {algo!r}")
    if caching not in ("True", "False"):
        raise CacheConfigError(f"enable_prefix_caching is {caching!r}")
    return EngineCacheConfig(
        block_size=block_size, hash_algo=algo, prefix_caching=caching == "True"
    )


def pool_cache_config(engines: Mapping[str, EngineCacheConfig]) -> EngineCacheConfig:
    """The one configuration of a pool's engines (keyed by replica URL); raises
    CacheConfigError naming the replicas when they disagree."""
    if not engines:
        raise CacheConfigError("no engines to compare")
    groups: dict[EngineCacheConfig, list[str]] = {}
    for url, config in engines.items():
        groups.setdefault(config, []).append(url)
    if len(groups) > 1:
        described = "; ".join(
            f"{', '.join(urls)}: block {c.block_size}, {c.hash_algo}, "
            f"prefix caching {'on' if c.prefix_caching else 'off'}"
            for c, urls in groups.items()
        )
        raise CacheConfigError(f"replicas of one pool hash blocks differently: {described}")
    return next(iter(groups))
