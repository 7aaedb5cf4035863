"""vLLM's prefix-cache block hashes, computed by the proxy from a prompt's token IDs.

A generate replica finds a prompt's cached prefix by hashing each full block of `block_size`
tokens, chained: `hash(parent_hash, block_tokens, extra_keys)`, the first block's parent being
`NONE_HASH = hash(seed)` (vLLM 0.32 `v1/core/kv_cache_utils.py`: `hash_block_tokens`,
`init_none_hash`, `generate_block_hash_extra_keys`; `utils/hashing.py` for the algorithms).
The proxy holds every prompt's token IDs before it picks a replica, so it can compute the same
hashes and compare them with what each replica holds (`blocks.BlockIndex`).

The seed: with `PYTHONHASHSEED` set in the engine's environment, vLLM seeds with that string
(whatever it is: "0", "random" and "" are all used as text). Unset, sha256 and sha256_cbor seed
with the fixed "vllm-none-hash", and xxhash / xxhash_cbor with 32 random bytes per process,
which nobody else can reproduce: such engines must run with `PYTHONHASHSEED` pinned
(`engine_seed`).

Extra keys, tagged as vLLM tags them: `("lora", name, path)` in every block of a LoRA request,
then `("cache_salt", salt)` in the first block only. Multimodal and prompt-embeds requests get
keys the proxy cannot compute; they are not for prefix routing.
"""

from __future__ import annotations

import array
import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, get_args

import numpy as np

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
"""vLLM's `--prefix-caching-hash-algo` values."""
HASH_ALGOS: tuple[HashAlgo, ...] = get_args(HashAlgo)
DEFAULT_SEED = "vllm-none-hash"
"""The seed of sha256 and sha256_cbor engines without PYTHONHASHSEED."""
PICKLE_PROTOCOL = 5
"""`pickle.HIGHEST_PROTOCOL` of the Pythons vLLM runs on (3.8-3.13), which vLLM hashes with."""
KEY_MASK = (1 << 64) - 1

Digest = Callable[[bytes], bytes]
Extra = tuple[tuple[str, ...], ...] | None


class LoraKey(NamedTuple):
    """A LoRA adapter as vLLM keys its blocks: `LoRARequest.lora_name` and `.lora_path`."""

    name: str
    path: str


def engine_seed(algo: HashAlgo, pythonhashseed: str | None) -> str:
    """The seed an engine derives NONE_HASH from, given its `PYTHONHASHSEED` (None: unset).

    Raises ValueError where no one else can know it: xxhash algorithms without PYTHONHASHSEED.
    """
    if pythonhashseed is not None:
        return pythonhashseed
    if algo.startswith("xxhash"):
        raise ValueError(
            f"{algo} engines seed their block hashes randomly unless PYTHONHASHSEED is set: "
            "pin PYTHONHASHSEED on every engine and give the proxy the same value"
        )
    return DEFAULT_SEED


def block_key(block_hash: bytes | int) -> int:
    """The 64-bit form KV events carry by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`):
    the hash's last 8 bytes, big-endian. Ints pass through."""
    if isinstance(block_hash, int):
        return block_hash & KEY_MASK
    return int.from_bytes(block_hash[-8:], "big")


def block_keys(hashes: Sequence[bytes]) -> list[int]:
    """`block_key` of each hash, at once (all of one length, as one hasher makes them)."""
    if not hashes:
        return []
    words = len(hashes[0]) // 8
    flat = np.frombuffer(b"".join(hashes), dtype=">u8")
    keys: list[int] = flat[words - 1 :: words].tolist()
    return keys


def extra_keys(*, first: bool, cache_salt: str | None, lora: LoraKey | None) -> Extra:
    """A block's extra keys as vLLM builds them (None when there are none)."""
    keys: list[tuple[str, ...]] = []
    if lora is not None:
        keys.append(("lora", lora.name, _apart(lora.path, lora.name)))
    if first and cache_salt:
        keys.append(("cache_salt", _apart(cache_salt, *(lora or ()))))
    return tuple(keys) if keys else None


def _apart(text: str, *others: str) -> str:
    """`text` as an object of its own: pickle writes one object met twice as a back-reference,
    and vLLM's name, path and salt are separate objects (decoded separately), so ours must be
    too. (One-character strings are shared by every Python alike.)"""
    if len(text) > 1 and any(text is other for other in others):
        return text[:1] + text[1:]
    return text


class BlockHasher:
    """One engine configuration's block hashes: `hashes(token_ids)` is what the engine's
    `Request.block_hashes` holds for that prompt (full blocks only)."""

    __slots__ = ("_chain", "_digest", "_serialize", "algo", "block_size", "none_hash", "seed")

    def __init__(self, block_size: int, algo: HashAlgo = "sha256", seed: str | None = None):
        """`seed`: the engines' `PYTHONHASHSEED` if they set one (`engine_seed`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash algorithm {algo!r} (one of {', '.join(HASH_ALGOS)})")
        self.block_size = block_size
        self.algo: HashAlgo = algo
        self.seed = engine_seed(algo, seed)
        self._digest = _digest_of(algo)
        cbor = algo.endswith("_cbor")
        self._serialize: Callable[[Any], bytes] = cbor_dumps if cbor else _pickle_dumps
        self._chain = self._chain_cbor if cbor else self._chain_pickle
        self.none_hash = self._digest(self._serialize(self.seed))

    def __repr__(self) -> str:
        return f"BlockHasher({self.block_size}, {self.algo!r}, seed={self.seed!r})"

    def hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: LoraKey | None = None,
    ) -> list[bytes]:
        """The chained hash of every full block of `token_ids`, first block first."""
        blocks = len(token_ids) // self.block_size
        if not blocks:
            return []
        first = extra_keys(first=True, cache_salt=cache_salt, lora=lora)
        rest = extra_keys(first=False, cache_salt=cache_salt, lora=lora)
        return self._chain(token_ids, blocks, first, rest)

    def keys(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora: LoraKey | None = None,
    ) -> list[int]:
        """`hashes` as the 64-bit keys KV events and `BlockIndex` use."""
        return block_keys(self.hashes(token_ids, cache_salt=cache_salt, lora=lora))

    def block_hash(self, parent: bytes | None, tokens: Sequence[int], extra: Extra) -> bytes:
        """One block's hash as vLLM's `hash_block_tokens` computes it (None: the first)."""
        parent = parent or self.none_hash
        return self._digest(self._serialize((parent, tuple(tokens), extra)))

    def _chain_pickle(
        self, token_ids: Sequence[int], blocks: int, first: Extra, rest: Extra
    ) -> list[bytes]:
        # vLLM's own serialization, one block at a time: pickling a block costs less than
        # hashing it, so building the bytes by hand saved ~10% at 16-token blocks
        digest, dumps, bs = self._digest, pickle.dumps, self.block_size
        ids = tuple(token_ids)
        parent = digest(dumps((self.none_hash, ids[:bs], first), PICKLE_PROTOCOL))
        out = [parent]
        for start in range(bs, blocks * bs, bs):
            parent = digest(dumps((parent, ids[start : start + bs], rest), PICKLE_PROTOCOL))
            out.append(parent)
        return out

    def _chain_cbor(
        self, token_ids: Sequence[int], blocks: int, first: Extra, rest: Extra
    ) -> list[bytes]:
        bs = self.block_size
        body, ends = cbor_uints(token_ids[: blocks * bs], bs)
        head = b"\x83" + _cbor_head(2, len(self.none_hash))
        mid = _cbor_head(4, bs)
        tails = (cbor_dumps(first), cbor_dumps(rest))
        digest = self._digest
        out: list[bytes] = []
        parent, start = self.none_hash, 0
        for end in ends:
            parent = digest(head + parent + mid + body[start:end] + tails[start > 0])
            out.append(parent)
            start = end
        return out


def _pickle_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, PICKLE_PROTOCOL)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _digest_of(algo: HashAlgo) -> Digest:
    if algo.startswith("sha256"):
        return _sha256
    try:
        import xxhash  # vLLM's optional dependency for these algorithms
    except ImportError as exc:
        raise ValueError(f"{algo} needs the xxhash package (pip install xxhash)") from exc
    digest: Digest = xxhash.xxh3_128_digest
    return digest


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head, shortest form (what cbor2 writes, canonical or not)."""
    top = major << 5
    if value < 24:
        return bytes((top | value,))
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes((top | extra,)) + value.to_bytes(width, "big")
    raise ValueError(f"{value} does not fit a CBOR head")


def cbor_dumps(obj: Any) -> bytes:
    """CBOR of what block hashes contain (None, ints, str, bytes, tuples), as vLLM's
    `cbor2.dumps(obj, canonical=True)` writes it."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(map(cbor_dumps, obj))
    raise TypeError(f"no CBOR form for {type(obj).__name__}")


# Per token width class (1, 2, 3 or 5 bytes): its head, and how far its big-endian value
# shifts right so that only the bytes it needs follow the head.
_HEADS = np.array([0, 0x18, 0x19, 0x1A], dtype=np.uint64)
_SHIFTS = np.array([0, 24, 16, 0], dtype=np.uint64)
_WIDTHS = np.array([1, 2, 3, 5], dtype=np.uint8)
_ROW = np.arange(8, dtype=np.uint8)


def cbor_uints(token_ids: Sequence[int], block_size: int) -> tuple[bytes, list[int]]:
    """The CBOR items of `token_ids` (all below 2**32), concatenated, and the end offset of
    each `block_size` run of them: every block's body without a loop over tokens."""
    ids = np.frombuffer(array.array("I", token_ids), dtype=np.uint32)
    cls = (ids >= 24).astype(np.uint8) + (ids >= 256) + (ids >= 65536)
    big_endian = ids.byteswap().astype(np.uint64)
    # one little-endian uint64 row per token: the head in byte 0, then the value's bytes
    rows = np.where(
        cls == 0, ids.astype(np.uint64), _HEADS.take(cls) | (big_endian >> _SHIFTS.take(cls)) << 8
    )
    widths = _WIDTHS.take(cls)
    keep = np.flatnonzero(widths[:, None] > _ROW)
    body = rows.view(np.uint8).take(keep).tobytes()
    ends: list[int] = np.cumsum(widths, dtype=np.int64)[block_size - 1 :: block_size].tolist()
    return body, ends
