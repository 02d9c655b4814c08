"""Fault injection through the launcher: one rank dies somewhere in a ZeRO job; the job stops at once.

One rank dies (an exception, os._exit(1) or SIGKILL to itself) before init_distributed, after
initialize, inside forward, inside backward, while the others are blocked in a collective, or inside
save_checkpoint, at 2 and 4 ranks (tests/launcher/fault_rank.py). Each time the launcher must exit
non-zero, name the rank and show its last output, and leave no process behind. The time from the death
to the launcher's exit is printed (pytest -s) and only bounded loosely; docs/launcher.md gives the figures.

By default each place is tried at both sizes with the three ways of dying spread over them (12 jobs);
SHARDSPEED_FAULTS=full runs every combination (36 jobs, a few minutes).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import REPO, alive, launcher_env, wait_until
from harness import free_port

FAULT_RANK_SCRIPT = str(Path(__file__).resolve().parent / "fault_rank.py")
WHERES = ["before_init", "after_initialize", "forward", "backward", "collective", "save_checkpoint"]
HOWS = ["raise", "exit", "sigkill"]
EXPECTED_CODE = {"raise": 1, "exit": 1, "sigkill": 128 + signal.SIGKILL}


def cases() -> list[tuple[str, str, int]]:
    if os.environ.get("SHARDSPEED_FAULTS") == "full":
        return list(itertools.product(WHERES, HOWS, [2, 4]))
    # Every place at both sizes; the ways of dying rotate so each appears at each size and in each place.
    return [
        (where, HOWS[(i + j) % 3], ranks) for i, where in enumerate(WHERES) for j, ranks in enumerate([2, 4])
    ]


def dying_rank(where: str, ranks: int) -> int:
    # Rank 0 hosts the rendezvous store: losing it before the others connect is its own path.
    return 0 if where == "before_init" else ranks - 1


def group_members(pgids: set[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of `pgids`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) in pgids and fields[0] != b"Z":
                found.append(int(entry))
    return found


@pytest.mark.parametrize(("where", "how", "ranks"), cases(), ids=lambda v: str(v))
def test_a_dying_rank_stops_the_job(tmp_path, where, how, ranks):
    rank = dying_rank(where, ranks)
    env = launcher_env(FAULT_OUT=str(tmp_path), FAULT_RANK=str(rank), FAULT_WHERE=where, FAULT_HOW=how)
    command = [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", str(ranks),
               "--master_port", str(free_port()), FAULT_RANK_SCRIPT]  # fmt: skip
    proc = subprocess.Popen(command, env=env, cwd=str(REPO), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=120)  # a hang is a failure, not a wait
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the launcher hung after rank {rank} died ({where}, {how}):\n{stderr[-3000:]}")
    exited_at = time.time()
    died_at = float((tmp_path / "died_at").read_text())
    latency = exited_at - died_at
    print(f"\nfault {where:16s} {how:7s} {ranks} ranks: launcher exited {latency:.2f} s after the death")

    assert proc.returncode == EXPECTED_CODE[how], stdout[-2000:] + stderr[-3000:]
    # An exception inside save_checkpoint is agreed by every rank (checkpoint/agree.py): all raise the same
    # error, naming the faulty rank, at once, so the launcher may see any of them exit first.
    agreed = where == "save_checkpoint" and how == "raise"
    named = int(re.search(r"rank (\d+) \(pid", stderr).group(1)) if agreed else rank
    assert f"rank {named} (pid" in stderr and f"exited with code {EXPECTED_CODE[how]}" in stderr, stderr
    # Its last output lines: the traceback when it raised, else its last print.
    last_line = f"RuntimeError: injected fault in rank {rank} ({where})" if how == "raise" else (
        f"| fault rank {rank} dying in {where} by {how}")  # fmt: skip
    if agreed:
        last_line = f"save_checkpoint failed on rank {rank}: {last_line}"
    assert last_line in stderr.split(f"output lines of rank {named}", 1)[-1], stderr
    assert "finished without a fault" not in stdout
    assert latency < 30, f"the launcher took {latency:.1f} s to stop the job"

    records = [json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")]
    assert len(records) == ranks
    pgids = {r["pgid"] for r in records}
    assert pgids == {r["pid"] for r in records}, "each rank leads its own process group"
    assert wait_until(lambda: not group_members(pgids), timeout=5), f"left behind: {group_members(pgids)}"
    assert not any(alive(r["pid"]) for r in records)
