"""`tokenline make-lora BASE_DIR OUT_DIR`: a LoRA adapter for a model directory, made offline.

The adapter is written in PEFT's layout, the one vLLM's loader reads (vllm/lora/peft_helper.py,
vllm/lora/lora_model.py): `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`base_model_name_or_path`, ...) and `adapter_model.safetensors`, holding for each layer `i` and
target module `m` the tensors `base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_A.weight`
of shape (r, in_features) and `...lora_B.weight` of shape (out_features, r). The shapes come from
the base model's `config.json` alone, so any Llama/Qwen2-style checkpoint works, the project's
tiny models and SmolLM2 among them.

The weights are seeded random numbers (numpy; no torch, no peft): the same base, settings and
seed give byte-identical files. Their size is set by `scale`, not by chance: the update PEFT
applies, ΔW = lora_alpha / r · B·A, maps an input of RMS 1 to an output of RMS about `scale`,
whatever the rank, alpha and width. The base's own attention projections have gains of ~1.7
(the test models) and ~1.5-7 (SmolLM2), so the default changes a greedy answer within a few
tokens: on SmolLM2 "The capital of France is Paris." becomes other text, which scale 0.25 leaves
as it is. `scale=0` makes an adapter that changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = (*ATTENTION, *MLP)
DEFAULT_RANK = 8
DEFAULT_ALPHA = 16
DEFAULT_SCALE = 1.0
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MARKER = ".complete"
RECIPE_VERSION = 1
"""Bumped when the same arguments would write other files: a cached adapter is then remade."""


class AdapterError(ValueError):
    """An adapter that cannot be made: a base directory without a usable config.json, or a
    setting out of range. The message names what is wrong."""


@dataclass(frozen=True)
class Shapes:
    """The widths a LoRA on a decoder layer's projections needs, from the base's config.json."""

    layers: int
    hidden: int
    q_dim: int
    """num_attention_heads · head_dim: q_proj's output, o_proj's input."""
    kv_dim: int
    """num_key_value_heads · head_dim: k_proj's and v_proj's output."""
    intermediate: int | None
    """The MLP's width (None: the config has none, and no MLP module can be targeted)."""

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Shapes:
        def need(key: str) -> int:
            value = cfg.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AdapterError(f"config.json: {key} must be a positive integer, not {value!r}")
            return value

        hidden, heads, layers = (
            need("hidden_size"),
            need("num_attention_heads"),
            need("num_hidden_layers"),
        )
        kv_heads = need("num_key_value_heads") if "num_key_value_heads" in cfg else heads
        head_dim = need("head_dim") if cfg.get("head_dim") is not None else hidden // heads
        inter = need("intermediate_size") if "intermediate_size" in cfg else None
        return cls(layers, hidden, heads * head_dim, kv_heads * head_dim, inter)

    def in_out(self, target: str) -> tuple[int, int]:
        """(in_features, out_features) of `target`'s linear layer."""
        if target in MLP and self.intermediate is None:
            raise AdapterError(f"config.json has no intermediate_size: cannot target {target}")
        widths = {
            "q_proj": (self.hidden, self.q_dim),
            "k_proj": (self.hidden, self.kv_dim),
            "v_proj": (self.hidden, self.kv_dim),
            "o_proj": (self.q_dim, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        fan_in, fan_out = widths[target]
        assert fan_in is not None and fan_out is not None
        return fan_in, fan_out


def read_base(base: Path) -> dict[str, Any]:
    """The base model's config.json, or an AdapterError saying why it cannot be used."""
    path = base / "config.json"
    if not base.is_dir():
        raise AdapterError(f"base model directory {base} does not exist")
    if not path.is_file():
        raise AdapterError(f"{base} has no config.json: not a model directory")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path} holds no JSON object")
    return cfg


def check(rank: int, alpha: int, scale: float, targets: Sequence[str]) -> None:
    """Refuse settings no adapter can have, naming the setting."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"rank must be an integer of at least 1, not {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int) or alpha < 1:
        raise AdapterError(f"lora_alpha must be a positive integer, not {alpha!r}")
    if not math.isfinite(scale) or scale < 0:
        raise AdapterError(f"scale must be a number of at least 0, not {scale!r}")
    if not targets:
        raise AdapterError("targets: name at least one module")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise AdapterError(f"targets: unknown module {unknown[0]!r}; choose from {TARGETS}")
    if len(set(targets)) != len(targets):
        raise AdapterError(f"targets: a module is named twice in {list(targets)}")


def weight_name(layer: int, target: str, half: str) -> str:
    """PEFT's tensor name for `half` ("A" or "B") of `target` in decoder layer `layer`."""
    block = "mlp" if target in MLP else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{half}.weight"


def adapter_weights(
    shapes: Shapes,
    targets: Sequence[str],
    rank: int,
    alpha: int,
    scale: float,
    seed: int,
) -> dict[str, np.ndarray]:
    """Seeded A and B for every layer and target (float32, as PEFT saves them).

    A's rows have RMS 1/√in, so A·x has RMS ~1 per component for an input of RMS 1; B's
    entries are sized so that alpha/r · B·(A·x) has RMS ~`scale`."""
    rng = np.random.default_rng(seed)
    b_std = scale * rank / (alpha * math.sqrt(rank))
    weights: dict[str, np.ndarray] = {}
    for layer in range(shapes.layers):
        for target in targets:
            fan_in, fan_out = shapes.in_out(target)
            a = rng.normal(0.0, 1 / math.sqrt(fan_in), size=(rank, fan_in))
            b = rng.normal(0.0, b_std, size=(fan_out, rank))
            weights[weight_name(layer, target, "A")] = a.astype(np.float32)
            weights[weight_name(layer, target, "B")] = b.astype(np.float32)
    return weights


def adapter_config(base: Path, targets: Sequence[str], rank: int, alpha: int) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a plain LoRA (vLLM requires `r`, `lora_alpha`
    and `target_modules`, and refuses bias, DoRA and modules_to_save, all off here)."""
    return {
        "base_model_name_or_path": str(base),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "target_modules": list(targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def make_lora(
    base: Path,
    out: Path,
    rank: int = DEFAULT_RANK,
    alpha: int = DEFAULT_ALPHA,
    seed: int = 0,
    scale: float = DEFAULT_SCALE,
    targets: Sequence[str] = ATTENTION,
) -> Path:
    """Write a LoRA adapter for the model in `base` into `out` (created if need be) and return
    `out`. An adapter already there from the same base config and arguments is kept as is."""
    targets = tuple(targets)
    check(rank, alpha, scale, targets)
    cfg = read_base(base)
    shapes = Shapes.from_config(cfg)
    for target in targets:
        shapes.in_out(target)  # refuses an MLP target before anything is written
    config = adapter_config(base, targets, rank, alpha)
    marker = _marker(cfg, config, scale, seed)
    if (out / MARKER).is_file() and (out / MARKER).read_text() == marker:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = adapter_weights(shapes, targets, rank, alpha, scale, seed)
    save_file(weights, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / MARKER).write_text(marker)
    return out


def _marker(cfg: dict[str, Any], config: dict[str, Any], scale: float, seed: int) -> str:
    """What a complete adapter records: the recipe and everything it was made from."""
    recipe = {"base": cfg, "config": config, "scale": scale, "seed": seed, "v": RECIPE_VERSION}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    return f"lora\n{digest[:16]}\n"
