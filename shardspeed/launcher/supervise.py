"""Run a set of processes as one job: each in its own session, output forwarded, the first failure stops all.

Used for the ranks of one node (launch.py) and for the per-node ssh/pdsh/mpirun processes (runner.py).
[Note: job teardown]
- Every worker starts with `start_new_session=True`, so its pid is also the id of a process group holding
  everything it forks (dataloader workers, compilers); the group is signalled, not just the leader.
- The watch loop polls every 0.05 s (DeepSpeed polls every 1 s). When a worker exits non-zero, or the
  launcher gets SIGINT/SIGTERM/SIGHUP, every group gets SIGTERM, then SIGKILL after `grace` seconds.
  Workers that hold a stdin pipe (ssh to another node) are first asked to stop by closing that pipe: the
  remote per-node launcher sees end-of-file and stops its own ranks, which a SIGTERM to the local ssh
  client alone would not do (sshd sends no signal to a command without a terminal).
- Each worker also gets PR_SET_PDEATHSIG=SIGKILL, so a launcher killed with SIGKILL (no chance to clean up)
  still takes its direct children with it.
- The launcher exits with the failing worker's code (128+N for a worker killed by signal N) and prints
  the failing worker's last output lines, kept in a small ring buffer per worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from shardspeed.launcher import LauncherError, log

TAIL_BYTES = 16384
TAIL_LINES = 20


@dataclass
class Worker:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    log_path: str | None = None  # stdout+stderr go to this file (--enable_each_rank_log)
    stdin_pipe: bool = False  # hold its stdin open; closing it asks the worker to stop (see the note)
    inherit_stdin: bool = False  # give it our stdin (a single-node rank may want pdb); else /dev/null
    failure_line: re.Pattern[bytes] | None = None  # an output line that means "a node failed" (pdsh)
    cpus: list[int] | None = None  # CPU affinity, set in the child before exec
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    tail: bytearray = field(default_factory=bytearray, init=False, repr=False)
    reported_code: int | None = field(default=None, init=False)  # from failure_line, before it exits

    def last_lines(self, count: int = TAIL_LINES) -> list[str]:
        data = bytes(self.tail)
        if self.log_path:
            with contextlib.suppress(OSError), open(self.log_path, "rb") as handle:
                handle.seek(max(0, os.path.getsize(self.log_path) - TAIL_BYTES))
                data = handle.read()
        return data.decode(errors="replace").splitlines()[-count:]


def exit_code(returncode: int) -> int:
    """A shell's view of a child's status: 128+N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _pdeathsig_setter():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # not Linux: the process groups still get cleaned up normally
        return lambda: None
    return lambda: prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


class Supervisor:
    """Start `workers`, forward their output, and stop all of them when one fails or we are signalled."""

    def __init__(
        self,
        workers: list[Worker],
        *,
        grace: float = 1.0,
        poll_interval: float = 0.05,
        stop_on_stdin_eof: bool = False,
    ):
        self.workers = workers
        self.grace = grace
        self.poll_interval = poll_interval
        self.stop_on_stdin_eof = stop_on_stdin_eof
        self._signal: int | None = None
        self._hurry = False  # a second signal while stopping: skip the grace period
        self._stdin_eof = False
        self._out_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        # Waiter and pump threads post (worker, exit code) here the moment a worker ends or reports a
        # failure, so the earliest failure is the one reported, not whichever the next poll sees first.
        self._ended: queue.Queue[tuple[Worker, int]] = queue.Queue()

    # ---- start ---------------------------------------------------------------------------------------
    def _spawn(self, worker: Worker) -> None:
        set_pdeathsig = _pdeathsig_setter()
        cpus = worker.cpus

        def child_setup() -> None:  # runs in the child between fork and exec
            set_pdeathsig()
            if cpus:
                os.sched_setaffinity(0, cpus)

        if worker.log_path:
            out = open(worker.log_path, "ab")  # noqa: SIM115 (closed right after the child has it)
            stdout, stderr = out, subprocess.STDOUT
        else:
            out, stdout, stderr = None, subprocess.PIPE, subprocess.PIPE
        stdin = (
            subprocess.PIPE if worker.stdin_pipe else (None if worker.inherit_stdin else subprocess.DEVNULL)
        )
        try:
            worker.proc = subprocess.Popen(
                worker.argv,
                env=worker.env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                preexec_fn=child_setup,
            )
        except OSError as err:
            raise LauncherError(f"cannot start {worker.name} ({worker.argv[0]}): {err.strerror}") from None
        finally:
            if out is not None:
                out.close()

    def _start_threads(self) -> None:
        for worker in self.workers:
            proc = worker.proc
            if proc is None:  # a signal arrived while starting; _watch stops the rest at once
                continue
            for pipe, target in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                if pipe is not None:
                    self._thread(self._pump, worker, pipe, target)
            self._thread(self._wait_for, worker, name="waiter")
        if self.stop_on_stdin_eof:
            self._thread(self._watch_stdin, name="stdin")

    def _thread(self, fn, *args, name: str = "pump") -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True, name=name)
        thread.start()
        self._threads.append(thread)

    def _wait_for(self, worker: Worker) -> None:
        self._ended.put((worker, exit_code(worker.proc.wait())))

    def _pump(self, worker: Worker, pipe, target) -> None:
        """Copy one worker's pipe to our stream in chunks (progress bars without newlines still show)."""
        out = getattr(target, "buffer", None)
        partial = b""
        fd = pipe.fileno()
        while chunk := os.read(fd, 65536):
            with self._out_lock:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    target.write(chunk.decode(errors="replace"))
                    target.flush()
            worker.tail += chunk
            del worker.tail[:-TAIL_BYTES]
            if worker.failure_line is not None:
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    match = worker.failure_line.search(line)
                    if match and worker.reported_code is None:
                        worker.reported_code = int(match.group("code")) or 1
                        self._ended.put((worker, worker.reported_code))
        pipe.close()

    def _watch_stdin(self) -> None:
        # We are the per-node launcher on another node: our stdin is the ssh channel from the runner.
        with contextlib.suppress(OSError, ValueError):
            while os.read(sys.stdin.fileno(), 4096):
                pass
        self._stdin_eof = True

    # ---- signals -------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:
            self._hurry = True
        self._signal = signum

    @contextlib.contextmanager
    def _signals(self):
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        if threading.current_thread() is not threading.main_thread():
            yield  # only the main thread may install handlers (embedded use)
            return
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # ---- run -----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to the end; return the process exit code the launcher should exit with."""
        with self._signals():
            try:
                for worker in self.workers:
                    self._spawn(worker)
                    if self._signal is not None:
                        break
            except LauncherError:
                self.stop_all()
                raise
            self._start_threads()
            return self._watch()

    def _watch(self) -> int:
        finished = 0
        while True:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                log.info(f"received {name}; stopping all {len(self.workers)} processes")
                self.stop_all()
                return 128 + self._signal
            if self._stdin_eof:
                log.info("lost the connection to the shardspeed runner (stdin closed); stopping")
                self.stop_all()
                return 128 + signal.SIGHUP
            try:
                worker, code = self._ended.get(timeout=self.poll_interval)
            except queue.Empty:
                continue
            if code != 0:
                return self._fail(worker, code)
            finished += 1
            if finished == len(self.workers):
                self._join_threads()
                return 0

    def _fail(self, worker: Worker, code: int) -> int:
        started = time.monotonic()
        others = sum(1 for w in self.workers if w is not worker and w.proc.returncode is None)
        log.error(
            f"{worker.name} (pid {worker.proc.pid}) exited with code {code}; stopping {others} other(s)"
        )
        self.stop_all()
        self._join_threads()
        lines = worker.last_lines()
        if lines:
            where = f" (full log: {worker.log_path})" if worker.log_path else ""
            body = "\n".join(f"    | {line}" for line in lines)
            log.error(f"last {len(lines)} output lines of {worker.name}{where}:\n{body}")
        log.error(
            f"job stopped {time.monotonic() - started:.2f} s after {worker.name} failed (exit code {code})"
        )
        return code

    def _join_threads(self) -> None:
        for thread in self._threads:
            if thread.name == "pump":
                thread.join(timeout=1.0)

    # ---- stop ----------------------------------------------------------------------------------------
    def stop_all(self) -> None:
        """SIGTERM (or close stdin) for every process group, SIGKILL for what is left after the grace."""
        started = [w for w in self.workers if w.proc is not None]
        polite = [w for w in started if w.stdin_pipe and w.proc.stdin is not None]
        for worker in polite:
            with contextlib.suppress(OSError):
                worker.proc.stdin.close()
        # The remote launcher needs about one grace period of its own to stop its ranks.
        if polite:
            self._wait_gone(polite, 2 * self.grace + 1.0)
        for worker in started:
            _signal_group(worker, signal.SIGTERM)
        self._wait_gone(started, self.grace)
        for worker in started:
            _signal_group(worker, signal.SIGKILL)
        for worker in started:
            worker.proc.wait()

    def _wait_gone(self, workers: list[Worker], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._hurry:
            if not any(_group_alive(w) for w in workers):
                return
            time.sleep(0.02)


def _group_alive(worker: Worker) -> bool:
    if worker.proc.returncode is None:  # set by its waiter thread once reaped
        return True
    if os.path.isdir("/proc/self"):
        return _live_group_members(worker.proc.pid) > 0
    try:
        os.killpg(worker.proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _live_group_members(pgid: int) -> int:
    """Members of a process group that are not zombies.

    killpg(pgid, 0) also succeeds for zombies, and in containers whose PID 1 does not reap, orphaned
    zombies stay forever; counting them would make every stop wait out the whole grace period.
    """
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":  # fields after "(comm)": state, ppid, pgrp
            count += 1
    return count


def _signal_group(worker: Worker, signum: int) -> None:
    if not _group_alive(worker):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(worker.proc.pid, signum)
