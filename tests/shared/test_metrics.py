"""`LoopHistogram` is exposed exactly as prometheus_client's `Histogram` with the same buckets
and observations (it replaces it for the per-token series)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tokenline.shared.metrics import LATENCY_BUCKETS, LoopHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _series(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without prometheus_client's `_created` timestamp."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line and "_created" not in line]


@given(
    st.lists(
        st.one_of(
            st.floats(min_value=0, max_value=20, allow_nan=False),
            st.sampled_from([*BUCKETS, *LATENCY_BUCKETS]),  # on a bound: counted in its bucket
        ),
        max_size=50,
    )
)
def test_exposed_as_prometheus_client_histogram(values: list[float]) -> None:
    for buckets in (BUCKETS, LATENCY_BUCKETS):
        ours, theirs = CollectorRegistry(), CollectorRegistry()
        loop = LoopHistogram("t_seconds", "doc", buckets, ours)
        reference = Histogram("t_seconds", "doc", buckets=buckets, registry=theirs)
        for v in values:
            loop.observe(v)
            reference.observe(v)
        assert _series(ours) == _series(theirs)


def test_counts_each_observation_once() -> None:
    registry = CollectorRegistry()
    loop = LoopHistogram("t", "doc", BUCKETS, registry)
    for v in (0.0005, 0.001, 0.5, 30.0):
        loop.observe(v)
    assert loop.counts == [2, 0, 0, 1, 1]
    assert registry.get_sample_value("t_count") == 4
    assert registry.get_sample_value("t_bucket", {"le": "+Inf"}) == 4
    assert registry.get_sample_value("t_bucket", {"le": "0.001"}) == 2
