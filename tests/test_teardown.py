"""The exit path: Gloo's worker threads are idle before interpreter finalisation, so a finished job exits 0.

The abort this guards against is a race (see [Note: Gloo teardown abort] in shardspeed/comm/teardown.py):
without the fix, 8 of 20 four-rank launches of tests/teardown_rank.py aborted here, so the two launches
below catch a regression about 9 times in 10; benchmarks/soak_teardown.py runs it 100 times.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[1]

IDLE_PROBE = """
import os, torch, torch.distributed as dist
from shardspeed.comm.teardown import _gloo_worker_states, quiesce_gloo_workers
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=1)
works = [dist.broadcast(t, src=0, async_op=True) for t in torch.zeros(64).split(8)]
for w in works:
    w.wait()
states = _gloo_worker_states()
assert states, "no Gloo worker threads found by name"
assert quiesce_gloo_workers(timeout=10), "Gloo workers never went idle"
assert all(state == "S" for state, _ in _gloo_worker_states().values())
print("idle", len(states))
"""


def test_gloo_workers_are_found_and_go_idle(tmp_path):
    env = {"STORE": str(tmp_path / "store"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", IDLE_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("idle ")


@pytest.mark.parametrize("destroy", ["0", "1"], ids=["group-left-to-exit", "script-destroys-group"])
def test_four_ranks_exit_cleanly_after_async_collectives(destroy):
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "GLOO_SOCKET_IFNAME": "lo",
        "TEARDOWN_DESTROY": destroy,
    }
    command = [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", "4", "--master_port",
               str(free_port()), str(ROOT / "tests" / "teardown_rank.py")]  # fmt: skip
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line for line in proc.stdout.splitlines() if line.endswith("done")) == [
        f"teardown rank {r} done" for r in range(4)
    ]
