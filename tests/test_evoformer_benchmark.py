"""benchmarks/evoformer.py's GPU path, run on the CPU: parity check, per-system memory and interleaved
times, the block's n_res search and the report, on tiny shapes (the real run needs a GPU)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import evoformer_gpu  # noqa: E402


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(evoformer_gpu, "QUICK_GRID", [(2, 24)])
    monkeypatch.setattr(evoformer_gpu, "DTYPES", {"fp32": torch.float32})
    monkeypatch.setattr(evoformer_gpu, "PARITY_DTYPES", {"fp32": torch.float32})
    monkeypatch.setattr(evoformer_gpu, "QUICK_BLOCK_N_RES", [8, 12])
    return types.SimpleNamespace(rounds=2, quick=True, budget_mib=1e6)


def test_gpu_benchmark_path_runs_on_the_cpu(tiny):
    result, lines = evoformer_gpu.run_device(tiny, "cpu")
    for system, error in result["parity"]["fp32"].items():
        assert error < 1e-5, system
    (row,) = result["grid"]["fp32"]
    assert set(row["peak_mib"]) == set(evoformer_gpu.SYSTEMS)
    assert all(peak is not None and peak > 0 for peak in row["peak_mib"].values())
    assert all(len(row["seconds"][system]) == 2 for system in evoformer_gpu.SYSTEMS)
    for run in result["block"]["runs"]:  # the budget is never reached: every n_res fits
        assert [step["n_res"] for step in run["steps"]] == [8, 12] and run["largest"]["n_res"] == 12
    table = "\n".join(lines)
    assert "| 2 | 24 |" in table and "Largest n_res, DS4Sci_EvoformerAttention / plain: 1.00x." in table


def test_block_search_stops_at_the_budget(tiny):
    from benchmarks.evoformer import BLOCK

    run = evoformer_gpu.block_search("plain", [8, 12], 0.0, BLOCK, "cpu")
    assert [step["n_res"] for step in run["steps"]] == [8] and run["largest"] is None
