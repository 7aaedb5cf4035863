"""`tokenline plan`: the arithmetic on cases worked by hand, the figures read from a result
shaped by the bench's own functions, and the command's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenline.launch import cli
from tokenline.launch.bench import cpu
from tokenline.launch.plan import (
    Costs,
    Engines,
    Figure,
    Load,
    bench_point,
    cpu_tier,
    from_bench,
    plan,
    replicas,
)

COSTS = Costs(Figure(625.0, "given"), Figure(31.0, "given"), Figure(44.0, "given"))


def test_replicas_round_up_and_never_reach_zero() -> None:
    assert replicas(0.0, 10.0) == 1
    assert replicas(10.0, 10.0) == 1
    assert replicas(10.5, 10.0) == 2
    assert replicas(1000.0, 700.0 * 0.7) == 3


def test_a_cpu_tier_is_its_load_times_its_cost_over_the_busy_share() -> None:
    tier = cpu_tier("render", 1000.0, "req/s", 700.0, 0.7)  # 0.7 s of CPU a second
    assert tier.cores == pytest.approx(1.0)
    assert tier.per_replica == pytest.approx(1000.0)
    assert tier.replicas == 1
    assert cpu_tier("render", 1001.0, "req/s", 700.0, 0.7).replicas == 2
    assert cpu_tier("render", 1000.0, "req/s", 700.0, 0.35).cores == pytest.approx(2.0)


def test_each_tier_scales_on_its_unit_of_work() -> None:
    load = Load(requests_per_s=40, prompt_tokens=1000, output_tokens=200)
    engines = Engines(prefill_tokens_per_s=20_000, decode_streams=64, stream_tokens_per_s=50)
    tiers = {t.name: t for t in plan(COSTS, load, engines, utilization=0.7)}
    assert tiers["render"].load == 40 and tiers["render"].cores == pytest.approx(40 * 625e-6 / 0.7)
    assert tiers["derender"].load == 8000  # 40 x 200 tokens, one a chunk
    assert tiers["derender"].cores == pytest.approx(8000 * 31e-6 / 0.7)
    assert tiers["proxy"].cores == pytest.approx(8000 * 44e-6 / 0.7)
    assert tiers["generate-prefill"].load == 40_000
    assert tiers["generate-prefill"].replicas == 3  # 40,000 / (20,000 x 0.7) = 2.86
    assert tiers["generate-decode"].load == pytest.approx(160)  # 40/s x 4 s a stream
    assert tiers["generate-decode"].replicas == 4  # 160 / (64 x 0.7) = 3.57
    two = {t.name: t for t in plan(COSTS, load, engines, 0.7, tokens_per_chunk=2.0)}
    assert two["derender"].load == 4000


def test_generate_pools_are_planned_only_from_given_figures() -> None:
    load = Load(40, 1000, 200)
    assert [t.name for t in plan(COSTS, load)] == ["render", "derender", "proxy"]
    assert "generate-decode" not in [t.name for t in plan(COSTS, load, Engines(decode_streams=8))]


def _result(levels: dict[int, float]) -> dict[str, object]:
    """A bench result whose tokenline points spent `seconds` of CPU per process at each
    level, built by the bench's own CPU accounting."""
    points = []
    for level, seconds in levels.items():
        used = cpu.Split(
            parts=(
                ("bench-proxy", 2 * seconds),
                ("bench-render", seconds / 10),
                ("bench-derender", seconds),
            )
        )
        point = {"target": "tokenline", "level": level, "tokens_per_request": 100.0}
        point |= {"output_tokens_per_s": 1000.0, **cpu.per_token(used, 10_000, has_front=True)}
        points.append(point)
    points.append({"target": "engine", "level": 99, "tokens_per_request": 100.0})
    return {"mode": "double", "load": "c", "points": points}


def test_figures_come_from_the_highest_load_tokenline_point() -> None:
    result = _result({4: 0.5, 16: 0.3})
    assert bench_point(result)["level"] == 16
    found, where = from_bench(result, None, 1.0)
    assert found["proxy"].value == pytest.approx(60.0)  # 0.6 s over 10,000 tokens
    assert found["derender"].value == pytest.approx(30.0)
    assert found["render"].value == pytest.approx(3.0 * 100)  # per token x tokens a request
    assert "c=16" in where and "100 output tokens a request" in where
    assert from_bench(result, 4, 1.0)[0]["proxy"].value == pytest.approx(100.0)
    with pytest.raises(SystemExit, match="no tokenline point at level 8"):
        bench_point(result, 8)


def test_the_command_prints_its_plan_and_measurements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(_result({16: 0.3})))
    argv = ["plan", "--requests-per-s", "40", "--prompt-tokens", "1000", "--output-tokens", "200"]
    argv += ["--measurements", str(path), "--proxy-us-per-token", "50"]
    argv += ["--prefill-tokens-per-s", "20000", "--decode-streams", "64"]
    argv += ["--stream-tokens-per-s", "50"]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert f"measurements used from {path} (tokenline, double mode, c=16" in out
    assert "render    300 us CPU a request  (measured: 3.00 us a token x 100)" in out
    assert "proxy     50 us CPU an output token  (given)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-5:]}
    assert rows["derender"][1:4] == ["8,000", "chunks/s", "0.34"]  # 8,000 x 30 us / 0.7
    assert rows["proxy"][3:5] == ["0.57", "1"]
    assert rows["generate-prefill"][5] == "3" and rows["generate-decode"][4] == "4"


def test_without_figures_it_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no build/bench here
    argv = ["plan", "--requests-per-s", "1", "--prompt-tokens", "1", "--output-tokens", "1"]
    with pytest.raises(
        SystemExit, match="no figure for render, derender, proxy: run `tokenline bench`"
    ):
        cli.main(argv)
