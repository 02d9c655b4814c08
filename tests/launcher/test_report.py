"""`shardspeed report`: versions, backends, devices, /dev/shm, launcher tools; no compiled-op noise."""

import subprocess
import sys

from shardspeed.launcher import report

from .helpers import REPO


def test_report_sections_and_content(capsys):
    assert report.main([]) == 0
    text = capsys.readouterr().out
    for needle in (
        "python ..",
        "torch version",
        "torch install path",
        "shardspeed version",
        "gloo (CPU)",
        "nccl (NVIDIA GPU)",
        "mpi ..",
        "cuda available",
        "/dev/shm",
        "launcher backends",
        "ssh ..",
        "pdsh ..",
        "openmpi ..",
        "features that work here",
    ):
        assert needle in text, needle
    assert "gloo (CPU) ...." in text and "[YES]" in text.split("gloo (CPU)")[1].splitlines()[0]
    assert "ninja" not in text and "op name" not in text  # nothing is compiled, so nothing to report


def test_small_shm_warns(monkeypatch, capsys):
    monkeypatch.setattr(report, "shm_bytes", lambda path="/dev/shm": 64 * 1024**2)
    report.main(["--hide_operator_status"])  # ds_report's flag is accepted
    assert "WARNING: under 512 MB" in capsys.readouterr().out


def test_shardspeed_report_subcommand():
    result = subprocess.run(
        [sys.executable, "-m", "shardspeed.launcher.runner", "report"],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "shardspeed report: general environment" in result.stdout
