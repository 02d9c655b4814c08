"""benchmarks/prefix_cache.py runs end to end (two servers on loopback, one round, two clients): a smoke run
of the script the README's prefix-caching figures come from, not a measurement (no time is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

for _extra in ("fastapi", "uvicorn", "httpx", "transformers", "prometheus_client"):
    pytest.importorskip(_extra, reason="the serve extra is not installed (integration stage only)")

ROOT = Path(__file__).resolve().parents[2]


def test_prefix_cache_benchmark_runs_and_reports(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "prefix_cache.py"), "--rounds", "1", "--clients", "2",
               "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "prefix_cache_demo.json").read_text())
    assert len(result["ratio"]) == 1 and result["same_answers"] is True, result
    assert result["setup"]["system_prompt_tokens"] == 256 and "0.75M parameters" in result["setup"]["model"]
    assert "ratio off / on" in (tmp_path / "prefix_cache_demo.md").read_text()
