"""vLLM's tracing flags, as the launcher gives them: `--otlp-traces-endpoint` and an export
over HTTP/protobuf under a service name per role, from the standard variables unless the flag
says otherwise; nothing without either."""

from __future__ import annotations

import argparse

import pytest

from tokenline.services.generate.launcher import (
    GenerateConfig,
    add_arguments,
    command,
    environment,
    from_args,
)

URL = "http://collector:4318/v1/traces"


def _config(**settings: object) -> GenerateConfig:
    return GenerateConfig(model="/m", vllm_bin="/bin/vllm", **settings)  # type: ignore[arg-type]


def test_an_engine_traces_only_with_an_endpoint() -> None:
    plain = _config()
    assert "--otlp-traces-endpoint" not in command(plain)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in environment(plain, {})
    argv = command(_config(otlp_traces_endpoint=URL))
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == URL


@pytest.mark.parametrize(
    ("role", "name"), [("both", "vllm"), ("prefill", "vllm-prefill"), ("decode", "vllm-decode")]
)
def test_vllm_exports_over_http_under_its_roles_name(role: str, name: str) -> None:
    env = environment(_config(otlp_traces_endpoint=URL, role=role), {})
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # (vLLM's default: gRPC)
    assert env["OTEL_SERVICE_NAME"] == name
    given = environment(_config(otlp_traces_endpoint=URL), {"OTEL_SERVICE_NAME": "mine"})
    assert given["OTEL_SERVICE_NAME"] == "mine"


def test_render_mode_takes_no_tracing_flag() -> None:
    assert "--otlp-traces-endpoint" not in command(_config(mode="render", otlp_traces_endpoint=URL))


def _generate(argv: list[str]) -> GenerateConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    return from_args(args, extra)


def test_tokenline_generate_reads_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert _generate(["--model", "/m"]).otlp_traces_endpoint is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert _generate(["--model", "/m"]).otlp_traces_endpoint == URL
    flag = ["--model", "/m", "--otlp-traces-endpoint", "http://other:1/v1/traces"]
    assert _generate(flag).otlp_traces_endpoint == "http://other:1/v1/traces"
