"""Replica choice: pools, health, retries, and what the engines already hold."""
