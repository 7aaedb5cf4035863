"""`launch/bench/metrics.py`: what the benchmarks read of Prometheus pages (`steps.py`, `pd.py`
and `hop.py` need vLLM or a whole stack and run by hand)."""

from __future__ import annotations

from tokenline.launch.bench.metrics import Delta, samples, total

BEFORE = """# HELP vllm:iteration_tokens_total Number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{engine="0",model_name="tiny"} 100.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="tiny"} 10.0
vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 10.0
# HELP tokenline_proxy_hop_seconds Latency of each hop call
# TYPE tokenline_proxy_hop_seconds histogram
tokenline_proxy_hop_seconds_sum{hop="render"} 1.0
tokenline_proxy_hop_seconds_count{hop="render"} 4.0
tokenline_proxy_hop_seconds_sum{hop="derender"} 2.0
tokenline_proxy_hop_seconds_count{hop="derender"} 40.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 16.0
"""
AFTER = (
    BEFORE.replace(
        '_sum{engine="0",model_name="tiny"} 100.0', '_sum{engine="0",model_name="tiny"} 370.0'
    )
    .replace(
        '_count{engine="0",model_name="tiny"} 10.0', '_count{engine="0",model_name="tiny"} 20.0'
    )
    .replace('_sum{hop="render"} 1.0', '_sum{hop="render"} 1.5')
    .replace('_count{hop="render"} 4.0', '_count{hop="render"} 6.0')
)


def test_a_histograms_mean_over_what_came_between_two_pages() -> None:
    window = Delta(samples(BEFORE), samples(AFTER))
    assert window.mean("vllm:iteration_tokens_total") == 27.0  # 270 / 10
    assert window.mean("tokenline_proxy_hop_seconds", 'hop="render"') == 0.25
    assert window.mean_ms("tokenline_proxy_hop_seconds", 'hop="render"') == 250.0
    # nothing observed between the pages: no mean, not a zero (in ms: 0, as pd.py prints it)
    assert window.mean("tokenline_proxy_hop_seconds", 'hop="derender"') is None
    assert window.mean_ms("tokenline_proxy_hop_seconds", 'hop="derender"') == 0.0
    assert window.mean("vllm:no_such_histogram") is None
    assert window.mean("vllm:num_requests_running") is None  # a gauge has no mean
    # a series is summed over the labels asked for, every one when none are
    assert total(samples(AFTER), "tokenline_proxy_hop_seconds_count") == 46.0
