"""The buckets DistributedOptimizer makes for CUDA gradients (hybridpipe.data_parallel.optimizer._cuda_buckets): consecutive in
reverse model order, each up to the fusion threshold or one larger parameter. (The buckets' reduction runs on the
GPU in tests/gpu.)"""

from __future__ import annotations

import torch

from hybridpipe.data_parallel.optimizer import _cuda_buckets


def named(*sizes: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(size, dtype=dtype))) for i, size in enumerate(sizes)]


def test_buckets_run_backwards_through_the_model_up_to_the_threshold():
    # 4-byte floats: 100 elements = 400 bytes
    assert _cuda_buckets(named(100, 100, 100, 100), 800) == [["p3", "p2"], ["p1", "p0"]]
    assert _cuda_buckets(named(100, 100, 100), 1000) == [["p2", "p1"], ["p0"]]
    assert _cuda_buckets(named(100, 100, 100), 1200) == [["p2", "p1", "p0"]]


def test_a_parameter_larger_than_the_threshold_is_a_bucket_of_its_own():
    assert _cuda_buckets(named(10, 5000, 10, 10), 800) == [["p3", "p2"], ["p1"], ["p0"]]
    assert _cuda_buckets(named(5000), 800) == [["p0"]]


def test_bytes_count_not_elements():
    assert _cuda_buckets(named(100, 100, 100, 100, dtype=torch.float16), 800) == [["p3", "p2", "p1", "p0"]]


def test_every_parameter_in_exactly_one_bucket():
    sizes = [7, 300, 1, 4096, 12, 12, 900, 3]
    buckets = _cuda_buckets(named(*sizes), 2048)
    flat = [name for bucket in buckets for name in bucket]
    assert flat == [f"p{i}" for i in reversed(range(len(sizes)))]
    assert all(bucket for bucket in buckets)
