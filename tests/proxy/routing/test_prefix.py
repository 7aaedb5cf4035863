"""Block hashes against vLLM's own code, run in this process: its request block hasher, extra
keys, seed resolution and event hash form."""

from __future__ import annotations

import functools
import os
import warnings
from types import SimpleNamespace
from typing import Any
from unittest import mock

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenline.proxy.routing.prefix import (
    DEFAULT_SEED,
    BlockHasher,
    HashAlgo,
    LoraKey,
    block_key,
    block_keys,
    cbor_dumps,
    engine_seed,
)

pytestmark = pytest.mark.unit


@functools.cache
def vllm() -> SimpleNamespace:
    """vLLM's own hashing, imported when a test first needs it: importing vLLM loads torch
    (seconds), which collecting this module should not cost every run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # importing vLLM (torch) warns about their deprecations
        from vllm.lora.request import LoRARequest
        from vllm.utils import hashing
        from vllm.v1.core import kv_cache_utils
    return SimpleNamespace(LoRARequest=LoRARequest, hashing=hashing, kv_cache_utils=kv_cache_utils)


ALGOS: tuple[HashAlgo, ...] = ("sha256", "sha256_cbor")  # xxhash is not installed here
TOKEN = st.one_of(
    st.integers(0, 23), st.integers(0, 300), st.integers(0, 70_000), st.integers(0, 2**31 - 1)
)


def vllm_hashes(
    ids: list[int],
    block_size: int,
    algo: HashAlgo,
    *,
    salt: str | None = None,
    lora: LoraKey | None = None,
    pythonhashseed: str | None = None,
) -> list[bytes]:
    """What a vLLM engine with this configuration puts in `Request.block_hashes`."""
    env = {} if pythonhashseed is None else {"PYTHONHASHSEED": pythonhashseed}
    with mock.patch.dict(os.environ, env, clear=False):
        if pythonhashseed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        function = vllm().hashing.get_hash_fn_by_name(algo)
        vllm().kv_cache_utils.init_none_hash(function)
    # name, path and salt reach vLLM's engine as objects of their own (decoded apart), even
    # when equal (pickle would write one met twice as a back-reference)
    path = None if lora is None else lora.path[:1] + lora.path[1:]
    salt = None if salt is None else salt[:1] + salt[1:]
    request = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(ids),
        all_token_ids=ids,
        mm_features=[],
        lora_request=None if lora is None else vllm().LoRARequest(lora.name, 1, path),
        cache_salt=salt,
        prompt_embeds=None,
    )
    hashes: list[bytes] = vllm().kv_cache_utils.get_request_block_hasher(block_size, function)(
        request
    )
    return hashes


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(TOKEN, max_size=300),
    block_size=st.sampled_from([1, 2, 3, 4, 16, 128]),
    algo=st.sampled_from(ALGOS),
    salt=st.one_of(st.none(), st.just(""), st.text(max_size=20)),
    lora=st.one_of(
        st.none(), st.builds(LoraKey, st.text(max_size=8), st.text(min_size=1, max_size=12))
    ),
)
def test_hashes_equal_vllms(
    ids: list[int], block_size: int, algo: HashAlgo, salt: str | None, lora: LoraKey | None
) -> None:
    ours = BlockHasher(block_size, algo).hashes(ids, cache_salt=salt, lora=lora)
    assert ours == vllm_hashes(ids, block_size, algo, salt=salt, lora=lora)
    assert len(ours) == len(ids) // block_size


@pytest.mark.parametrize("algo", ALGOS)
def test_long_prompt_at_cpu_and_gpu_block_sizes(algo: HashAlgo) -> None:
    ids = [(i * 7919) % 151_936 for i in range(5000)]
    for size in (16, 128):
        assert BlockHasher(size, algo).hashes(ids, cache_salt="s") == vllm_hashes(
            ids, size, algo, salt="s"
        )


def test_lora_name_and_path_as_one_object() -> None:
    """vLLM's LoRA name and path are two objects; pickle must not see one twice."""
    ids = list(range(64))
    same = "adapter-1"
    assert BlockHasher(16).hashes(ids, lora=LoraKey(same, same)) == vllm_hashes(
        ids, 16, "sha256", lora=LoraKey(same, "".join(["adapter", "-1"]))
    )


def test_salt_and_lora_change_every_hash_they_should() -> None:
    hasher = BlockHasher(4)
    ids = list(range(12))
    plain = hasher.hashes(ids)
    salted = hasher.hashes(ids, cache_salt="x")
    lora = hasher.hashes(ids, lora=LoraKey("a", "/a"))
    # the salt sits in the first block only, but every later hash chains from it
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert all(p != s for p, s in zip(plain, lora, strict=True))
    assert hasher.hashes(ids, cache_salt="") == plain  # vLLM ignores an empty salt
    assert hasher.hashes(ids[:11]) == plain[:2]  # only full blocks


@pytest.mark.parametrize("seed", ["0", "12345", "random", ""])
@pytest.mark.parametrize("algo", ALGOS)
def test_pythonhashseed_is_the_seed(seed: str, algo: HashAlgo) -> None:
    ids = list(range(40))
    ours = BlockHasher(16, algo, seed=engine_seed(algo, seed)).hashes(ids)
    assert ours == vllm_hashes(ids, 16, algo, pythonhashseed=seed)
    assert ours != BlockHasher(16, algo).hashes(ids)


@pytest.mark.parametrize(
    ("algo", "env"),
    [("sha256", None), ("sha256", "7"), ("sha256_cbor", None), ("xxhash", "7")],
)
def test_engine_seed_follows_vllm(algo: HashAlgo, env: str | None) -> None:
    with mock.patch.dict(os.environ, {} if env is None else {"PYTHONHASHSEED": env}):
        if env is None:
            os.environ.pop("PYTHONHASHSEED", None)
        theirs = vllm().kv_cache_utils.resolve_none_hash_seed(
            vllm().hashing.get_hash_fn_by_name(algo)
        )
    assert engine_seed(algo, env) == theirs
    assert engine_seed(algo, env) == (env if env is not None else DEFAULT_SEED)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_a_pinned_seed_is_refused(algo: HashAlgo) -> None:
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        engine_seed(algo, None)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        BlockHasher(16, algo)


def test_none_hash_is_vllms() -> None:
    for algo in ALGOS:
        vllm_hashes([], 16, algo)
        assert BlockHasher(16, algo).none_hash == vllm().kv_cache_utils.NONE_HASH


@pytest.mark.parametrize("bad", [0, -16])
def test_bad_block_size(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(bad)


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher(16, "md5")  # type: ignore[arg-type]


@given(st.lists(st.binary(min_size=32, max_size=32), max_size=20))
def test_keys_are_what_events_carry(hashes: list[bytes]) -> None:
    with mock.patch.object(vllm().kv_cache_utils.envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", True):
        theirs = [vllm().kv_cache_utils.maybe_convert_block_hash(h) for h in hashes]
    assert block_keys(hashes) == theirs
    assert [block_key(h) for h in hashes] == theirs
    assert [block_key(k) for k in theirs] == theirs


def test_keys_of_16_byte_hashes() -> None:
    hashes = [bytes(range(16)), bytes(range(16, 32))]
    assert block_keys(hashes) == [int.from_bytes(h[8:], "big") for h in hashes]


CBOR_VALUES = st.recursive(
    st.none() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary() | st.booleans(),
    lambda inner: st.lists(inner, max_size=5).map(tuple),
    max_leaves=20,
)


@given(CBOR_VALUES)
def test_cbor_is_cbor2_canonical(value: Any) -> None:
    assert cbor_dumps(value) == cbor2.dumps(value, canonical=True)
