#!/usr/bin/env bash
# The test command: sets up .venv (vLLM CPU build included) on a fresh machine, then runs the
# linters, the type checker and the whole test suite, real-vLLM tests included.
#
# Every test has a kind (tests/conftest.py): unit (no vLLM engine, no network namespace), slow
# (neither, but seconds each), fleet (real vLLM engines) or hosts (tests/hosts/: namespaces,
# root). The fast run is the unit tests alone, server-free, on both cores: about 65 s of CPU,
# 46 s of wall time on this idle 2-core machine (its Hypothesis tests try at most 10 examples
# each: `-m unit` loads the `fast` profile):
#
#   .venv/bin/python -m pytest -m unit -n 2
#
# With no arguments, the unit and slow tests run first, shuffled (full Hypothesis examples), on
# both cores,
# then the fleet and hosts tests in file order, which the fleet's memory needs: its nine vLLMs
# stop after their last user, before `tokenline up` starts engines of its own; last, the
# `alone` tests (the real model's P/D pair) in a run of their own. The shuffle's seed is the
# commit's, so a run is repeatable and successive commits try other orders: the
# run's header prints it (--random-order-seed=N: give pytest that, with -p random_order, to
# replay the order); TOKENLINE_TEST_SEED overrides it. With arguments: `pytest ARGS` alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
seed=${TOKENLINE_TEST_SEED:-$((16#$(git rev-parse --short=7 HEAD 2>/dev/null || echo 0)))}
.venv/bin/python -m pytest -m "unit or slow" -n 2 -p random_order --random-order-seed="$seed"
.venv/bin/python -m pytest -m "(fleet or hosts) and not alone"
# the real model's P/D pair: two more engines, once the fleet's nine have gone
.venv/bin/python -m pytest -m alone
