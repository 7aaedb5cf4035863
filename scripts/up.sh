#!/usr/bin/env bash
# Run the whole pipeline locally (sets up .venv first on a fresh machine). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Serves SmolLM2-135M-Instruct, built once into models/smollm2 (gitignored), unless --model
# names another; `tokenline up` alone serves the tiny test model.
case " $* " in
  *" --model "* | *" --model="*) exec .venv/bin/tokenline up "$@" ;;
esac
.venv/bin/tokenline make-model smollm2 models/smollm2 >/dev/null
exec .venv/bin/tokenline up --model models/smollm2 "$@"
