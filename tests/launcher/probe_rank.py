"""A rank for the launcher tests that needs no torch: records what it received, then behaves as told.

Behaviour comes from SHARDSPEED_TEST_* variables (that prefix is exported to other nodes):
OUT (directory for rank<R>.json), FAIL_RANK + FAIL_CODE + FAIL_AFTER (that rank exits with that code
after that many seconds), SLEEP (seconds the other ranks run), IGNORE_TERM (ignore SIGTERM), LINES (lines
to print first).
"""

import json
import os
import signal
import sys
import time

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
    "SSH_CONNECTION",
    "SHARDSPEED_TEST_VALUE",
    "FROM_ENV_FILE",
    "NCCL_TEST_VAR",
    "NOT_EXPORTED_VAR",
)


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def main() -> int:
    env = os.environ
    rank = int(env.get("RANK", "-1"))
    if env.get("SHARDSPEED_TEST_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record = {
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "env": {k: env.get(k) for k in KEYS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "cwd": os.getcwd(),
        "ppid": os.getppid(),
        "saved_pid": _read(f"/tmp/{os.getppid()}.deepspeed"),  # what --save_pid wrote, if anything
    }
    out = env["SHARDSPEED_TEST_OUT"]
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)
    for i in range(int(env.get("SHARDSPEED_TEST_LINES", "0"))):
        print(f"probe rank {rank} line {i}", flush=True)
    if str(rank) == env.get("SHARDSPEED_TEST_FAIL_RANK"):
        time.sleep(float(env.get("SHARDSPEED_TEST_FAIL_AFTER", "0")))
        print(f"probe rank {rank} failing now", file=sys.stderr, flush=True)
        with open(os.path.join(out, "failed_at"), "w") as handle:
            handle.write(repr(time.time()))
        return int(env.get("SHARDSPEED_TEST_FAIL_CODE", "3"))
    time.sleep(float(env.get("SHARDSPEED_TEST_SLEEP", "0")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
