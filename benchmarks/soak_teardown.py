"""Soak the exit path: N successful multi-rank ZeRO runs through the `shardspeed` launcher, count failures.

    python benchmarks/soak_teardown.py --runs 100 --ranks 4 --stage 2

Every run must exit 0; a run that does not is counted and its last output lines are printed (an abort at
interpreter exit shows as exit code 134 and "terminate called without an active exception"). Bounded:
each run has a --run-timeout and the whole soak stops after --max-minutes. Prints one summary line and
exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "benchmarks" / "teardown_job.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(ranks: int, stage: int, steps: int, timeout: float) -> tuple[int, float, str]:
    env = dict(os.environ, SOAK_STAGE=str(stage), SOAK_STEPS=str(steps), GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", str(ranks),
               "--master_port", str(free_port()), JOB]  # fmt: skip
    started = time.monotonic()
    try:
        proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, output = -1, f"timed out after {timeout:.0f} s\n{err.stdout or ''}{err.stderr or ''}"
    return code, time.monotonic() - started, output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--run-timeout", type=float, default=120.0)
    p.add_argument("--max-minutes", type=float, default=60.0)
    args = p.parse_args(argv)
    deadline = time.monotonic() + 60 * args.max_minutes
    failures, durations = [], []
    for run in range(1, args.runs + 1):
        if time.monotonic() > deadline:
            print(f"stopping after {run - 1} runs: --max-minutes {args.max_minutes} reached")
            break
        code, seconds, output = one_run(args.ranks, args.stage, args.steps, args.run_timeout)
        durations.append(seconds)
        ok = code == 0 and "teardown job done" in output
        if not ok:
            failures.append(code)
            tail = "\n".join("    | " + line for line in output.splitlines()[-15:])
            print(f"run {run}: FAILED (exit code {code}) after {seconds:.1f} s\n{tail}", flush=True)
        elif run % 10 == 0:
            print(f"run {run}: ok ({len(failures)} failed so far)", flush=True)
    done = len(durations)
    mean = sum(durations) / max(1, done)
    print(f"soak: {len(failures)}/{done} runs failed ({args.ranks} ranks, ZeRO-{args.stage}, {args.steps} steps; "
          f"exit codes {sorted(set(failures)) or '-'}; {mean:.1f} s per run)")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
