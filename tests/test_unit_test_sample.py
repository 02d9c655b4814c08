"""The conformance script's sampled mode (benchmarks/unit_test_sample.py): the same ids for the same seed and
file, and the estimate that counts full-run files exactly and scales each sampled file by its size."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from unit_test_sample import choose_sample, tree_estimate

IDS = [f"unit/a.py::test_{i}" for i in range(30)]


def test_sample_is_fixed_by_seed_and_file():
    first = choose_sample(IDS, 3, 36, "unit/a.py")
    assert first == choose_sample(
        list(reversed(IDS)), 3, 36, "unit/a.py"
    )  # order of collection does not matter
    assert len(first) == 3 and set(first) <= set(IDS)
    assert choose_sample(IDS, 3, 37, "unit/a.py") != first or choose_sample(IDS, 3, 38, "unit/a.py") != first
    assert choose_sample(IDS[:2], 3, 36, "unit/a.py") == sorted(IDS[:2])  # fewer than K: all of them


def _row(outcomes: dict) -> dict:
    return {"tests": outcomes}


def test_estimate_counts_full_files_exactly_and_scales_sampled_ones():
    results = {
        "files": {
            "unit/full.py": {  # DeepSpeed passes 4, the alias 3 of those
                "deepspeed": _row({f"t{i}": "passed" for i in range(4)} | {"t9": "failed"}),
                "shardspeed": _row({"t0": "passed", "t1": "passed", "t2": "passed", "t3": "failed"}),
            },
            "unit/sampled.py": {"shardspeed": _row({})},  # alias side only in full: counts by its sample
            "unit/nothing.py": {},
        },
        "sampled": {
            "unit/sampled.py": {  # 20 collected, 2 sampled: DeepSpeed passes both, the alias one
                "deepspeed_collected": 20,
                "ids": ["s0", "s1"],
                "deepspeed": _row({"s0": "passed", "s1": "passed"}),
                "shardspeed": _row({"s0": "passed", "s1": "failed"}),
            }
        },
    }
    estimate = tree_estimate(results)
    assert (estimate["full_deepspeed_passed"], estimate["full_both_passed"]) == (4, 3)
    assert (estimate["estimated_deepspeed_passed"], estimate["estimated_both_passed"]) == (24.0, 13.0)
    assert estimate["estimated_share"] == round(13 / 24, 4)
    assert estimate["unmeasured_files"] == ["unit/nothing.py"]
    assert (estimate["sampled_files"], estimate["sampled_tests"], estimate["sampled_deepspeed_passed"]) == (
        1,
        2,
        2,
    )
