"""Gradient bucket layout: only the first bucket (the last layers, whose gradients arrive first) gets the small
cap; every later one the large cap (or the configured size), across optimizer groups and dtype runs too.

The layout sets how many collectives a step issues at stages 0-2: a small cap on every bucket multiplied them
(23 instead of 2 on the benchmarks' small GPT) without changing any result, so only a test of the layout
itself catches it.
"""

import torch
from torch import nn

from shardspeed.core.grad_buckets import BUCKET_CAP_NUMEL, FIRST_BUCKET_CAP_NUMEL, bucket_layout


def _params(*numels: int, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.empty(n, device="meta", dtype=dtype)) for n in numels]


def _sizes(layout) -> list[int]:
    return [sum(p.numel() for p in params) for _, params in layout]


def test_only_the_first_bucket_gets_the_small_cap():
    # 16 parameters of 2**16 elements: the first bucket stops at the small cap (4 of them), the remaining
    # 12 fit under the large cap in one bucket.
    params = _params(*[2**16] * 16)
    assert _sizes(bucket_layout([params], 10**9)) == [FIRST_BUCKET_CAP_NUMEL, 12 * 2**16]


def test_the_configured_size_wins_when_smaller():
    params = _params(*[1000] * 10)
    assert _sizes(bucket_layout([params], 3000)) == [3000, 3000, 3000, 1000]


def test_later_groups_and_dtype_runs_are_not_first():
    # Two optimizer groups (the last is laid out first) and, inside one, two communication dtypes: only the
    # very first bucket of the whole layout is capped small.
    first_group = _params(*[2**16] * 8)
    second_group = _params(*[2**16] * 12) + _params(*[2**16] * 8, dtype=torch.bfloat16)
    layout = bucket_layout([first_group, second_group], 10**9, split_by=lambda p: p.dtype)
    assert [g for g, _ in layout] == [1, 1, 1, 0]
    assert _sizes(layout) == [FIRST_BUCKET_CAP_NUMEL, 8 * 2**16, 8 * 2**16, 8 * 2**16]
    assert all(len({p.dtype for p in params}) == 1 for _, params in layout)


def test_a_parameter_over_the_cap_gets_its_own_bucket():
    params = _params(10, BUCKET_CAP_NUMEL + 5, 10)
    assert _sizes(bucket_layout([params], 10**9)) == [10, BUCKET_CAP_NUMEL + 5, 10]
