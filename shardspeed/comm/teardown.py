"""Leave torch.distributed cleanly at interpreter exit: let Gloo's worker threads go idle first.

[Note: Gloo teardown abort]
With torch 2.13 a finished process sometimes died at exit with "terminate called without an active
exception" (SIGABRT, exit code 134): about 1 in 12 four-rank ZeRO-2 runs on two cores. A core dump shows
why. Each Gloo process group runs collectives on worker threads (`pt_gloo_runloop`). A worker marks a
work complete, which wakes the rank's `wait()`, and only afterwards drops its own reference to the work
object. If that is the last reference, the work's tensors are freed on the worker thread, and freeing a
tensor that has a Python object needs the GIL. When the main thread has meanwhile reached interpreter
finalisation, CPython makes any thread that takes the GIL exit on the spot (`pthread_exit`); the forced
unwind runs into the work's `noexcept` destructor and the C++ runtime calls `std::terminate`. The last
collectives of a job (ZeRO's all-gather after the final step, a loss all-reduce) leave exactly such
releases pending, and on a loaded machine the worker may not get a CPU before the main thread finishes.

`destroy_process_group()` does not help by itself: Gloo has no shutdown, and the group's threads are only
joined when the last reference to the group goes, which in a training script is usually during
finalisation. So at exit, while the interpreter is still whole, `quiesce_gloo_workers` releases the GIL in
short sleeps until every Gloo worker thread has been seen blocked and not woken across a sleep: an idle
worker waits on its queue without waking, whereas one that still has a work to drop is running, or is
waiting for the GIL, and so wakes every few milliseconds (CPython's GIL wait is a timed wait). Threads are
found by name in /proc; elsewhere (not Linux) this is a no-op. Measured here: launches of 4 ranks that end
right after asynchronous broadcasts (tests/teardown_rank.py) aborted 8 times in 20 without this wait and
0 times in 40 with it; benchmarks/soak_teardown.py gives the figure for a ZeRO-2 job.
"""

from __future__ import annotations

import os
import time

GLOO_WORKER_NAME = "pt_gloo_runloop"
TASKS = "/proc/self/task"


def _gloo_worker_states() -> dict[str, tuple[str, int]] | None:
    """{thread id: (state letter, context switches so far)} for this process's Gloo worker threads."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None  # no /proc: nothing to inspect
    states = {}
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/comm") as handle:
                if handle.read().strip() != GLOO_WORKER_NAME:
                    continue
            with open(f"{TASKS}/{tid}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0].decode()
            with open(f"{TASKS}/{tid}/status") as handle:
                switches = sum(int(line.split()[1]) for line in handle if "ctxt_switches" in line)
        except (OSError, IndexError, ValueError):
            continue  # the thread ended while we looked
        states[tid] = (state, switches)
    return states


def quiesce_gloo_workers(timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Wait (GIL released) until no Gloo worker thread still has work to finish; True when they are idle.

    Idle means: every worker was blocked (state S) before and after a sleep of `interval` and did not run
    in between. Gives up after `timeout` seconds (a worker stuck in a collective whose peer has gone).
    """
    deadline = time.monotonic() + timeout
    before = _gloo_worker_states()
    if not before:
        return True
    while True:
        time.sleep(interval)  # releases the GIL: a worker waiting for it finishes its release now
        after = _gloo_worker_states()
        if not after:
            return True
        blocked = all(state == "S" for state, _ in after.values())
        unchanged = all(before.get(tid) == seen for tid, seen in after.items())
        if blocked and unchanged:
            return True
        if time.monotonic() > deadline:
            return False
        before = after
