"""`launch/bench/steps.py`'s reading of Prometheus pages (the bench itself needs vLLM and runs
by hand, as the other benches do)."""

from __future__ import annotations

from tokenline.launch.bench.steps import histogram_sums, mean_between

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
    before, after = histogram_sums(BEFORE), histogram_sums(AFTER)
    assert mean_between(before, after, "vllm:iteration_tokens_total") == 27.0  # 270 / 10
    assert mean_between(before, after, "tokenline_proxy_hop_seconds", {"hop": "render"}) == 0.25
    # nothing observed between the pages: no mean, not a zero
    assert mean_between(before, after, "tokenline_proxy_hop_seconds", {"hop": "derender"}) is None
    assert mean_between(before, after, "vllm:no_such_histogram") is None
    assert not any(name.startswith("vllm:num_requests") for name, _ in before)  # gauges: none
