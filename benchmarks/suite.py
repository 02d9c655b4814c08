"""The interleaved run: rounds x systems in A B C A B C order, one fresh job per (round, system), then medians.

Interleaving spreads slow drifts of a shared machine (other users, thermal state) over every system alike
instead of charging them to whichever ran last. A system that cannot run (not installed, a shardspeed stage
not implemented yet) or fails is recorded once with its reason and skipped in later rounds.

On a shared machine, other users' processes take cores in the middle of a job. Each job measures how many
cores others used during its timed steps (machine CPU time minus our ranks' own); the summary uses only the
quiet rounds of a system (others under CONTENDED_CORES) when it has any, and says how many it used.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field

from benchmarks.measure import zero_formula_bytes
from benchmarks.models import MODELS, Hyper
from benchmarks.systems import BASELINE_TREE_ENV, resolve
from benchmarks.worker import JobSpec, run_job

__all__ = ["SuiteSpec", "busy_cores", "load_average", "run_suite"]

LOSS_RTOL = 1e-5  # fp32, replicated data: every system computes the same numbers up to kernel rounding
CONTENDED_CORES = 0.25  # a job during whose timed steps other processes used more is "contended"


@dataclass(frozen=True)
class SuiteSpec:
    model: str
    systems: list[str] = field(default_factory=lambda: ["all"])
    rounds: int = 3
    steps: int = 20
    warmup: int = 5
    micro_batch: int | None = None  # default: the model's
    seed: int = 0
    adam: str = "fused"
    quiet_gate: float | None = None  # before each job, wait until others use at most this many cores
    quiet_wait_s: float = 90.0  # ... but no longer than this per job (the wait is recorded)
    reduce_bucket_size: int | None = None  # override for the shardspeed and DeepSpeed engines
    max_grad_norm: float = 0.0  # gradient clipping in every system (engines: gradient_clipping); 0: off
    start_method: str = "spawn"  # of each job's ranks (worker.JobSpec.start_method)
    baseline_tree: str | None = (
        None  # the checkout the baseline-z* rows import (e.g. a worktree of an older commit)
    )


def load_average() -> float:
    """The 1-minute load average (how busy the shared machine is)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def busy_cores(window_s: float = 2.0) -> float:
    """Cores kept busy over `window_s` by everything on the machine (/proc/stat), while no job of ours runs."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    time.sleep(window_s)
    busy1, total1 = sample()
    cores = os.cpu_count() or 1
    return cores * (busy1 - busy0) / max(total1 - total0, 1)


def _wait_until_quiet(spec: SuiteSpec, log) -> float:
    """Wait (polling every 10 s, at most `spec.quiet_wait_s`) for other users' load to fall; returns it."""
    busy = busy_cores()
    if spec.quiet_gate is None:
        return busy
    deadline = time.monotonic() + spec.quiet_wait_s
    while busy > spec.quiet_gate and time.monotonic() < deadline:
        log(f"  others use {busy:.2f} cores > {spec.quiet_gate}: waiting")
        time.sleep(8)
        busy = busy_cores()
    return busy


def _others_during(ranks: list[dict]) -> float:
    """Cores other processes used during the timed steps: machine busy time minus all our ranks' own."""
    wall = max(r["window"]["wall_s"] for r in ranks)
    machine = statistics.mean(r["window"]["machine_busy_s"] for r in ranks)
    return max(0.0, (machine - sum(r["window"]["own_cpu_s"] for r in ranks)) / wall)


def _compact(ranks: list[dict]) -> dict:
    """One job's result, kept small: the slowest rank per step, rank 0's losses, per-rank memory."""
    return {
        "others_cores_during": _others_during(ranks),
        "step_times": [max(ts) for ts in zip(*(r["step_times"] for r in ranks))],
        "losses": ranks[0]["losses"],
        "final_losses": [r["losses"][-1] for r in ranks],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "rss_after_trim_bytes": [r["rss_after_trim_bytes"] for r in ranks],
        "model_state_bytes": [r["model_state_bytes"] for r in ranks],
        "model_state_held_bytes": [r["model_state_held_bytes"] for r in ranks],
        "comm_bytes": ranks[0]["comm_bytes"],
        "comm_zero_volume_bytes": ranks[0]["comm_zero_volume_bytes"],
        "comm_calls": ranks[0]["comm_calls"],
        "numel": ranks[0]["numel"],
        "library": ranks[0].get("library"),
    }


def _summarize(row: dict, tokens_per_rank_step: int) -> dict:
    every_job = row.pop("jobs")
    if not every_job:
        return row
    # Rounds during which other users' processes took CPU measure them, not us: leave them out when
    # at least one quiet round exists (all rounds stay in the JSON as round_medians).
    quiet = [j for j in every_job if j["others_cores_during"] <= CONTENDED_CORES]
    jobs = quiet or every_job
    times = [t for job in jobs for t in job["step_times"]]
    last, numel = jobs[-1], jobs[-1]["numel"]
    median = statistics.median(times)
    row.update(
        numel=numel, median_s=median, min_s=min(times), max_s=max(times),
        tokens_per_s=tokens_per_rank_step * row["world_size"] / median,
        peak_rss_bytes=max(b for job in jobs for b in job["peak_rss_bytes"]),
        rss_after_trim_bytes=max(last["rss_after_trim_bytes"]),
        model_state_bytes=max(last["model_state_bytes"]),
        model_state_held_bytes=max(last["model_state_held_bytes"]),
        formula_bytes=zero_formula_bytes(row["zero_stage"], numel, row["world_size"]),
        comm_bytes=last["comm_bytes"], comm_zero_volume_psi=last["comm_zero_volume_bytes"] / (4 * numel),
        comm_calls=last["comm_calls"], final_loss=last["final_losses"][0],
        final_losses_all=[job["final_losses"] for job in jobs],
        losses=last["losses"], round_medians=[statistics.median(j["step_times"]) for j in every_job],
        others_busy_cores=[j["others_busy_cores"] for j in every_job],
        others_cores_during=[round(j["others_cores_during"], 3) for j in every_job],
        rounds_used=len(jobs), rounds_run=len(every_job), library=last["library"],
    )  # fmt: skip
    return row


def _check_losses(rows: list[dict]) -> None:
    """Mark each row's final loss as matching the reference (one-process, else the first row) or not."""
    done = [r for r in rows if r["status"] == "ok"]
    if not done:
        return
    ref = next((r for r in done if r["system"] == "one-process"), done[0])["final_loss"]
    for r in done:
        every = [loss for job in r["final_losses_all"] for loss in job]
        r["loss_matches"] = all(abs(loss - ref) <= LOSS_RTOL * max(1.0, abs(ref)) for loss in every)


def _add_ratios(rows: list[dict]) -> None:
    by_name = {r["system"]: r for r in rows if r["status"] == "ok"}
    for base, key in (("one-process", "vs_one_process"), ("no-comm-x2", "vs_floor"), ("ddp", "vs_ddp")):
        if base in by_name:
            for r in by_name.values():
                r[key] = r["median_s"] / by_name[base]["median_s"]


def run_suite(spec: SuiteSpec, log=print) -> dict:
    """Run every (round, system) job of `spec`; returns the result dict report.py renders."""
    model = MODELS[spec.model]
    micro = spec.micro_batch or model.micro_batch
    if spec.baseline_tree:  # inherited by the spawned ranks of the baseline rows
        os.environ[BASELINE_TREE_ENV] = spec.baseline_tree
    systems = resolve(spec.systems)
    rows = {
        s.name: {"system": s.name, "family": s.family, "zero_stage": s.zero_stage,
                 "world_size": s.world_size, "status": s.unavailable(), "jobs": []}
        for s in systems
    }  # fmt: skip
    loads = [load_average()]
    started = time.time()
    for round_index in range(spec.rounds):
        for s in systems:
            row = rows[s.name]
            if row["status"] not in (None, "ok"):
                continue
            others = _wait_until_quiet(spec, log)
            job = JobSpec(
                s.name, spec.model, micro, spec.steps, spec.warmup, spec.seed,
                Hyper(impl=spec.adam, max_grad_norm=spec.max_grad_norm),
                reduce_bucket_size=spec.reduce_bucket_size, start_method=spec.start_method,
            )  # fmt: skip
            status, out = run_job(job)
            loads.append(load_average())
            if status == "ok":
                row["status"] = "ok"
                row["jobs"].append({**_compact(out), "others_busy_cores": others})
                log(f"round {round_index + 1}/{spec.rounds} {s.name}: "
                    f"{statistics.median(row['jobs'][-1]['step_times']):.4f} s/step (load {loads[-1]:.2f}, "
                    f"others used {others:.2f} cores before, "
                    f"{row['jobs'][-1]['others_cores_during']:.2f} during)")  # fmt: skip
            else:
                row["status"] = out.splitlines()[-1] if status == "error" else out
                row["error"] = out[-4000:] if status == "error" else None
                log(f"round {round_index + 1}/{spec.rounds} {s.name}: {status}: {row['status']}")
    summarized = [_summarize(row, micro * model.seq) for row in rows.values()]
    _add_ratios(summarized)
    _check_losses(summarized)
    return {
        "model": asdict(model), "settings": {**asdict(spec), "micro_batch": micro},
        "load_average": {"min": min(loads), "max": max(loads), "samples": loads},
        "wall_s": time.time() - started, "rows": summarized,
        "numel": next((r["numel"] for r in summarized if "numel" in r), None),
    }  # fmt: skip
