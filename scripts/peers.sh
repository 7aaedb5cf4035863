#!/usr/bin/env bash
# The peers `tokenline bench` measures beside tokenline, each in the environment it ships for:
# the SGLang model gateway (`smg` from PyPI) in its own venv, build/peers/smg, and smg's vLLM
# servicer (smg-grpc-servicer, for vLLM's gRPC server) in the vLLM venv. `tokenline bench`
# does the same by itself when the gateway is missing; this is for doing it ahead of time.
# Idempotent: a second run only checks. Prints the gateway's executable.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m tokenline.launch.bench.gateway install
