"""The cache-aware choice's weights from the proxy's flags and environment, to the chooser."""

from __future__ import annotations

import argparse

import pytest

from tokenline.proxy import config as proxy
from tokenline.proxy.app import generate_pool
from tokenline.proxy.routing.cache_config import EngineCacheConfig

pytestmark = pytest.mark.unit

REPLICAS = ("--render", "http://r", "--derender", "http://d", "--decode", "http://g", "--open")


def parsed(*argv: str, env: dict[str, str] | None = None) -> proxy.ProxyConfig:
    parser = argparse.ArgumentParser()
    proxy.add_arguments(parser, env=env or {})
    return proxy.from_args(parser.parse_args([*REPLICAS, *argv]))


def test_the_defaults_are_the_measured_ones() -> None:
    config = parsed()
    assert (config.routing_cap, config.routing_half_life) == (1.5, 300.0)
    assert (config.routing_stream_cost, config.routing_compute_cost) == (64.0, 2.0)


def test_flags_and_environment_reach_the_chooser() -> None:
    config = parsed(
        "--routing-cap", "2", "--routing-stream-cost", "32", "--routing-compute-cost", "1.5",
        env={"TOKENLINE_ROUTING_HALF_LIFE": "60"},
    )  # fmt: skip
    pool = generate_pool("decode", ("http://g",), {}, config)
    routing = pool.routing
    assert routing is not None
    assert routing.recent_half_life == 60.0
    routing._configure(EngineCacheConfig(block_size=16, hash_algo="sha256", prefix_caching=True))
    chooser = routing.chooser
    assert chooser is not None
    assert (chooser.cap, chooser.stream_cost, chooser.compute_cost) == (2.0, 32.0, 1.5)


def test_a_flag_wins_over_its_variable() -> None:
    config = parsed("--routing-cap", "3", env={"TOKENLINE_ROUTING_CAP": "2"})
    assert config.routing_cap == 3.0


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--routing-cap", "0.9"),  # the least loaded replica must qualify
        ("--routing-half-life", "0"),
        ("--routing-stream-cost", "-1"),
        ("--routing-compute-cost", "0"),
    ],
)
def test_out_of_range_weights_are_refused_at_start(flag: str, value: str) -> None:
    with pytest.raises(SystemExit):
        parsed(flag, value)
    var = "TOKENLINE_ROUTING_" + flag.removeprefix("--routing-").replace("-", "_").upper()
    with pytest.raises(SystemExit, match=var):
        parsed(env={var: value})


def test_help_names_each_weight_and_its_variable() -> None:
    parser = argparse.ArgumentParser()
    proxy.add_arguments(parser, env={})
    text = " ".join(parser.format_help().split())
    for name in ("cap", "half-life", "stream-cost", "compute-cost"):
        assert f"--routing-{name}" in text
    assert "standing" in text and "history" in text
    assert "TOKENLINE_ROUTING_CAP" in text
    assert set(proxy.ENV) >= {
        "TOKENLINE_ROUTING_CAP",
        "TOKENLINE_ROUTING_HALF_LIFE",
        "TOKENLINE_ROUTING_STREAM_COST",
        "TOKENLINE_ROUTING_COMPUTE_COST",
    }
