#!/usr/bin/env bash
# Run the whole pipeline locally (sets up .venv first on a fresh machine). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tokenline up "$@"
