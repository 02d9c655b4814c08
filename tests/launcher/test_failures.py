"""Failure propagation and signals: one failing rank stops the job; signals to the launcher leave no orphans.

Timings are measured and printed (run pytest with -s to see them); the only assertion on time is a loose
bound that a loaded CI machine still meets.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from .helpers import PROBE, REPO, alive, launcher_env, read_ranks, wait_until


def start_launcher(args, env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardspeed.launcher.runner", *args],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("ignore_term", [False, True], ids=["ranks-obey-sigterm", "ranks-ignore-sigterm"])
def test_failing_rank_stops_the_job(probe_out, ignore_term):
    env = launcher_env(
        SHARDSPEED_TEST_OUT=str(probe_out),
        SHARDSPEED_TEST_FAIL_RANK="1",
        SHARDSPEED_TEST_FAIL_CODE="7",
        SHARDSPEED_TEST_FAIL_AFTER="1.0",
        SHARDSPEED_TEST_SLEEP="120",
        SHARDSPEED_TEST_LINES="30",
        SHARDSPEED_STOP_GRACE="1.0",
    )
    if ignore_term:
        env["SHARDSPEED_TEST_IGNORE_TERM"] = "1"  # only SIGKILL after the grace period stops them
    proc = start_launcher(["--num_gpus", "3", PROBE], env)
    _, stderr = proc.communicate(timeout=60)
    exited_at = time.time()
    failed_at = float((probe_out / "failed_at").read_text())
    elapsed = exited_at - failed_at
    print(f"\nfailure propagation ({'ranks ignore SIGTERM' if ignore_term else 'ranks obey SIGTERM'}): "
          f"launcher exited {elapsed:.2f} s after rank 1 failed")  # fmt: skip
    assert proc.returncode == 7, stderr
    assert elapsed < 10
    assert "rank 1" in stderr and "exited with code 7" in stderr
    # The failing rank's last output lines are shown (only the last 20 of its 31 lines).
    assert "| probe rank 1 failing now" in stderr and "| probe rank 1 line 29" in stderr
    assert "| probe rank 1 line 5" not in stderr
    for seen in read_ranks(probe_out).values():
        assert not alive(seen["pid"]), f"rank {seen['env']['RANK']} (pid {seen['pid']}) survived"


def _rank_pids(probe_out, count: int) -> list[int]:
    assert wait_until(lambda: len(read_ranks(probe_out)) == count, timeout=30), "ranks did not start"
    return [seen["pid"] for seen in read_ranks(probe_out).values()]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_launcher_stops_every_rank(probe_out, signum):
    env = launcher_env(SHARDSPEED_TEST_OUT=str(probe_out), SHARDSPEED_TEST_SLEEP="120")
    proc = start_launcher(["--num_gpus", "2", PROBE], env)
    pids = _rank_pids(probe_out, 2)
    sent = time.monotonic()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=30)
    print(f"\n{signal.Signals(signum).name}: launcher exited after {time.monotonic() - sent:.2f} s")
    assert proc.returncode == 128 + signum, stderr
    assert f"received {signal.Signals(signum).name}" in stderr
    assert not any(alive(pid) for pid in pids), "a rank outlived the launcher"


def test_sigkill_to_launcher_takes_ranks_down(probe_out):
    # The launcher gets no chance to clean up; PR_SET_PDEATHSIG in each rank does it.
    env = launcher_env(SHARDSPEED_TEST_OUT=str(probe_out), SHARDSPEED_TEST_SLEEP="120")
    proc = start_launcher(["--num_gpus", "2", PROBE], env)
    pids = _rank_pids(probe_out, 2)
    proc.kill()
    proc.communicate(timeout=30)
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=10), "orphaned ranks after SIGKILL"


def test_rank_killed_by_signal_gives_shell_exit_code(probe_out, tmp_path):
    script = tmp_path / "suicide.py"
    script.write_text(
        "import os, signal, time\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n"
    )
    proc = start_launcher(["--num_gpus", "2", str(script)], launcher_env())
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert "rank 0" in stderr and f"exited with code {128 + signal.SIGKILL}" in stderr
    assert os.path.exists(script)
