"""One (round, system) job: what each spawned rank runs, and the launcher that spawns the ranks.

Each job is a fresh set of processes (2 ranks x 1 torch thread, Gloo on 127.0.0.1; one process for the
one-process row), so no system inherits another's allocator state, threads or process group. A rank runs
`warmup` steps, one untimed step under `CommCounter`, `steps` timed steps, and a last untimed step that
counts model-state bytes between its backward and its optimizer step (when gradients exist).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import measure
from benchmarks.models import MODELS, Hyper, build_model, make_batches

__all__ = ["JobSpec", "run_job"]


@dataclass(frozen=True)
class JobSpec:
    system: str
    model: str
    micro_batch: int
    steps: int
    warmup: int
    seed: int = 0
    hyper: Hyper = field(default_factory=Hyper)
    timeout_s: float = 900.0
    profile: bool = False  # run benchmarks/profile_step.py's body instead of the timed one
    reduce_bucket_size: int | None = None  # zero_optimization.reduce_bucket_size for both engines
    # how the ranks start: "spawn" (a fresh interpreter each, what a measurement wants) or "forkserver" (the
    # test suite's smoke run, whose fork server has torch imported already; its timings mean nothing)
    start_method: str = "spawn"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(job: JobSpec, trainer, batches) -> dict:
    def one_step(i: int) -> float:
        loss = trainer.backward(batches[i % len(batches)])
        trainer.step()
        return loss.item()  # a sync point; every system pays it once per step

    losses, times, i = [], [], 0
    for i in range(job.warmup):
        losses.append(one_step(i))
    counter = measure.CommCounter()
    with counter:
        losses.append(one_step(job.warmup))
    with measure.CpuWindow() as window:
        for i in range(job.warmup + 1, job.warmup + 1 + job.steps):
            start = time.perf_counter()
            losses.append(one_step(i))
            times.append(time.perf_counter() - start)
    loss = trainer.backward(batches[(job.warmup + 1 + job.steps) % len(batches)])
    state = measure.model_state_bytes(trainer.state_roots, trainer.hidden_state_bytes)
    trainer.step()
    losses.append(loss.item())
    return {
        "losses": losses,
        "step_times": times,
        "comm_bytes": counter.total_bytes,
        "comm_zero_volume_bytes": counter.zero_volume_bytes,
        "comm_calls": dict(counter.calls_by_op),
        "model_state_bytes": state.resident,
        "model_state_held_bytes": state.held,
        "window": {
            "wall_s": window.wall_s,
            "machine_busy_s": window.machine_busy_s,
            "own_cpu_s": window.own_cpu_s,
        },
    }


def _rank_main(job: JobSpec, rank: int, world_size: int, port: int) -> dict:
    from benchmarks.systems import SYSTEMS, BuildContext

    system = SYSTEMS[job.system]
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    spec = MODELS[job.model]
    model = build_model(spec, job.seed)
    numel = sum(p.numel() for p in model.parameters())
    ctx = BuildContext(
        model, spec, job.hyper, job.micro_batch, world_size, system.zero_stage, job.reduce_bucket_size
    )
    trainer = system.build(ctx)
    batches = make_batches(spec, job.micro_batch, job.seed)
    if job.profile:
        from benchmarks.profile_step import profile_steps

        return profile_steps(job, trainer, batches)
    result = _train(job, trainer, batches)
    result.update(
        rank=rank, numel=numel, peak_rss_bytes=measure.peak_rss_bytes(),
        rss_after_trim_bytes=measure.rss_after_trim_bytes(),
        library=getattr(sys.modules.get("shardspeed"), "__file__", None),  # which checkout ran (baseline rows)
    )  # fmt: skip
    return result


def _child(job: JobSpec, rank: int, world_size: int, port: int, env: dict, results) -> None:
    os.environ.update(env)
    if os.environ.get("SHARDSPEED_BENCH_USE_BASELINE"):  # a baseline-z* row: the other checkout's library
        sys.path.insert(0, os.environ["SHARDSPEED_BENCH_BASELINE_TREE"])
    from benchmarks.systems import SystemUnavailable

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    try:
        payload = ("ok", _rank_main(job, rank, world_size, port))
    except SystemUnavailable as why:
        payload = ("unavailable", str(why))
    except BaseException:
        payload = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    results.put((rank, buffer.getvalue()))


def _collect(procs, results, timeout_s: float) -> dict[int, tuple]:
    outputs: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    while len(outputs) < len(procs):
        try:
            rank, raw = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
            if dead:
                return {dead[0]: ("error", f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")}
            if time.monotonic() > deadline:
                return {0: ("error", f"job did not finish within {timeout_s:.0f} s (hang?)")}
            continue
        outputs[rank] = torch.load(io.BytesIO(raw), weights_only=False)
        if outputs[rank][0] != "ok":  # one rank's verdict is the job's; don't wait for a peer that may hang
            return {rank: outputs[rank]}
    return outputs


def remove_shared_memory_left_by(port: int | str) -> None:
    """DeepSpeed 0.19.8's CPU shared-memory all-reduce leaves two 66 MiB files in /dev/shm per job (named
    after the job's master port) and never removes them; a few hundred jobs fill the RAM they live in."""
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        leftover.unlink(missing_ok=True)


def run_job(job: JobSpec) -> tuple[str, object]:
    """Spawn the job's ranks; returns ("ok", [per-rank dicts]), ("unavailable", why) or ("error", text)."""
    from benchmarks.systems import SYSTEMS

    system = SYSTEMS[job.system]
    ctx = mp.get_context(job.start_method)
    results = ctx.Queue()
    port = _free_port()
    env = dict(system.env)
    procs = [
        ctx.Process(target=_child, args=(job, r, system.world_size, port, env, results))
        for r in range(system.world_size)
    ]
    for p in procs:
        p.start()
    try:
        outputs = _collect(procs, results, job.timeout_s)
    finally:
        for p in procs:  # only the processes this job started, by handle
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        remove_shared_memory_left_by(port)
    verdicts = [v for v in outputs.values() if v[0] != "ok"]
    if verdicts:
        return verdicts[0]
    return "ok", [outputs[r][1] for r in range(system.world_size)]
