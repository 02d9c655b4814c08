"""SIGKILL of a whole job around `save_checkpoint`: a fresh job loads a complete checkpoint, never a mix.

A small subset of benchmarks/kill_during_save.py (which runs the full set of random and fixed kill moments
over ZeRO stages 0-3 and NVMe offload): two kills at fixed moments inside a save — a partition file half
written, and the old copy of the re-saved `latest` tag moved aside (the window where an earlier writer lost
the checkpoint). The random kill moments are left to the benchmark, which runs many of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import kill_during_save  # noqa: E402


def test_killed_saves_leave_a_complete_checkpoint(tmp_path):
    plan = [
        ("stage3-nvme", 0.0, "aside"),
        ("stage1", 0.0, "partition"),
    ]
    results = kill_during_save.run(plan, tmp_path)
    for result in results:
        assert result["ok"], result
    aside, partition = results
    # The kill between the two renames of a re-save: the old copy is what loads, as the newest complete one.
    assert all(".slot1.replaced" in v and "step 2" in v for v in aside["verdicts"]), aside
    assert partition["hidden"] == [".slot1.incomplete"], partition
