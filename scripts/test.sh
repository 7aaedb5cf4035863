#!/usr/bin/env bash
# The test command: sets up .venv (vLLM CPU build included) on a fresh machine, then runs the
# linters, the type checker and the whole test suite, real-vLLM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
