"""Measuring instruments for investigating tokenline's costs, run from a checkout
(`python -m research.<name>` at its root) and not installed: see research/README.md."""
