"""Launching tokenline: the CLI, `tokenline up`, process supervision, offline model builders and
the benchmark. Product code that starts the services; the services never import it."""
