"""Step time against the floor, measured step by step: every system trains in the same two ranks, in turns.

    python benchmarks/paired_steps.py --systems ddp shardspeed-z0 shardspeed-z1 shardspeed-z2 --clips 0 1.0 \\
        --baseline-tree /tmp/old --jobs 3 --steps 40 --name small_paired

On a shared machine other users' processes take cores for seconds at a time, and one job per system
(run.py) sees a different share of the machine than the next job does. Here each rank builds every system on
its own copy of the model (same seed, same batches) and runs them in turns: iteration i runs one step of
each system (their order rotating), each after a barrier, and divides each system's step time by the step
time of the floor (`no-comm-x2`'s loop: the same model and optimizer, no collective, clipping with torch's
`clip_grad_norm_` when the row clips) taken in the same iteration, a few hundred milliseconds apart. The
median of these ratios over all steps is the headline; the per-job medians (one job = fresh processes)
show how far jobs spread.

Beside wall time, each step's CPU seconds (both ranks, every thread: Gloo's included) over the floor's: the
work a system adds, which other users' processes disturb far less than they disturb the wall clock (it
leaves out time a rank spends waiting for the other).

`--baseline-tree DIR ...` runs the same jobs with shardspeed imported from other checkouts (a `git archive`
or worktree of an older commit), alternating with this one (job 1 here, job 1 there, ...); every tree's
ratios are to its own in-process floor. Each rank uses one torch thread; times are the slowest rank's per
step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
FLOOR = "no-comm-x2"


def _rank(rank: int, port: int, args: dict, tree: str | None, out) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.models import MODELS, Hyper, build_model, make_batches
    from benchmarks.systems import SYSTEMS, BuildContext

    if tree:  # another checkout's library for every shardspeed row (this checkout's benchmarks stay loaded)
        sys.path.insert(0, tree)

    # The launcher's environment contract: DeepSpeed's rows read LOCAL_RANK and adopt the process group
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    for name in args["systems"]:
        os.environ.update(dict(SYSTEMS[name].env))  # e.g. DS_ACCELERATOR=cpu, before DeepSpeed is imported
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = MODELS[args["model"]]
    batches = make_batches(spec, spec.micro_batch, 0)
    trainers = {}
    for clip in args["clips"]:
        for name in [FLOOR, *args["systems"]]:
            system = SYSTEMS[name]
            hyper = Hyper(max_grad_norm=clip)
            ctx = BuildContext(build_model(spec, 0), spec, hyper, spec.micro_batch, 2, system.zero_stage)
            trainers[(name, clip)] = system.build(ctx)
    keys = list(trainers)
    times = {key: [] for key in keys}
    cpu = {key: [] for key in keys}
    losses = {key: [] for key in keys}
    for i in range(args["warmup"] + args["steps"]):
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:  # rotating order: no system always follows the same one
            trainer = trainers[key]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = trainer.backward(batches[i % len(batches)])
            trainer.step()
            losses[key].append(loss.item())
            if i >= args["warmup"]:
                times[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)  # every thread of the rank (Gloo's too)
    mine = torch.tensor([times[key] for key in keys], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank per step
    work = torch.tensor([cpu[key] for key in keys], dtype=torch.float64)
    dist.all_reduce(work, op=dist.ReduceOp.SUM)  # CPU seconds of both ranks per step
    library = getattr(sys.modules.get("shardspeed"), "__file__", None)
    dist.destroy_process_group()
    if rank == 0:
        out.put({"keys": [list(k) for k in keys], "times": mine.tolist(), "cpu": work.tolist(), "library": library,
                 "final_losses": [losses[k][-1] for k in keys]})  # fmt: skip


def _job(args: dict, tree: str | None) -> dict:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env = dict(OMP_NUM_THREADS="1")
    os.environ.update(env)
    procs = [ctx.Process(target=_rank, args=(r, port, args, tree, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        while True:
            try:
                return out.get(timeout=5)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank exited with code {dead[0]}") from None
    finally:
        for p in procs:  # only this job's ranks, by handle
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def _ratios(job: dict, measure: str = "times") -> dict:
    """Each (system, clip): its step times (or CPU seconds) over the floor's (same clip) in the same iteration."""
    index = {tuple(k): i for i, k in enumerate(job["keys"])}
    out = {}
    for (name, clip), i in index.items():
        floor = job[measure][index[(FLOOR, clip)]]
        out[(name, clip)] = [t / f for t, f in zip(job[measure][i], floor)]
    return out


def summarize(jobs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for tree, tree_jobs in jobs.items():
        per_job = [_ratios(job) for job in tree_jobs]
        per_job_cpu = [_ratios(job, "cpu") for job in tree_jobs]
        for key in per_job[0]:
            every = [r for ratios in per_job for r in ratios[key]]
            every_cpu = [r for ratios in per_job_cpu for r in ratios[key]]
            job_medians = [statistics.median(ratios[key]) for ratios in per_job]
            index = [tuple(k) for k in tree_jobs[0]["keys"]].index(key)
            seconds = [t for job in tree_jobs for t in job["times"][index]]
            rows.append({
                "tree": tree, "system": key[0], "clip": key[1], "median_ratio": statistics.median(every),
                "job_medians": job_medians, "p10": _quantile(every, 0.1), "p90": _quantile(every, 0.9),
                "median_s": statistics.median(seconds), "steps": len(every),
                "cpu_ratio": statistics.median(every_cpu),
                "cpu_job_medians": [statistics.median(ratios[key]) for ratios in per_job_cpu],
                "final_losses": [job["final_losses"][index] for job in tree_jobs],
            })  # fmt: skip
    return rows


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def markdown(result: dict) -> str:
    a = result["settings"]
    lines = [
        f"# Paired steps: {a['model']} GPT, each system's step time over the floor's in the same iteration",
        "",
        f"{a['jobs']} jobs per tree x {a['steps']} measured steps after {a['warmup']} warm-up; every system in "
        f"the same 2 ranks (1 thread each, Gloo), in rotating turns; fp32 torch AdamW (fused). Load average "
        f"(1 min) {result['load']['min']:.1f}-{result['load']['max']:.1f} on 2 cores: the machine was shared.",
        f"Trees: {', '.join(f'{k} = {v}' for k, v in result['trees'].items())}.",
        "",
        "| tree | system | clipping | median step s | wall vs floor, median of all steps | per-job medians | p10-p90 "
        "| CPU-s vs floor | per-job medians |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["system"] == FLOOR:
            continue
        clip = f"{r['clip']:g}" if r["clip"] else "off"
        jobs = ", ".join(f"{m:.3f}" for m in r["job_medians"])
        cpu_jobs = ", ".join(f"{m:.3f}" for m in r["cpu_job_medians"])
        lines.append(f"| {r['tree']} | {r['system']} | {clip} | {r['median_s']:.4f} | **{r['median_ratio']:.3f}x** "
                     f"| {jobs} | {r['p10']:.3f}-{r['p90']:.3f} | {r['cpu_ratio']:.3f}x | {cpu_jobs} |")  # fmt: skip
    floor_loss = {(r["tree"], r["clip"]): r["final_losses"] for r in result["rows"] if r["system"] == FLOOR}
    differ = [f"{r['tree']} {r['system']} clip {r['clip']:g}" for r in result["rows"]
              if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(r["final_losses"], floor_loss[(r["tree"], r["clip"])]))]  # fmt: skip
    lines += [
        "",
        "Final losses equal to the floor's (1e-5): "
        + ("all" if not differ else "not " + ", ".join(differ))
        + ".",
    ]
    floors = [r for r in result["rows"] if r["system"] == FLOOR]
    lines += ["", "Floor step time (median s): " + "; ".join(
        f"{r['tree']}, clipping {r['clip']:g}: {r['median_s']:.4f}" for r in floors) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument(
        "--systems", nargs="+", default=["ddp", "shardspeed-z0", "shardspeed-z1", "shardspeed-z2"]
    )
    parser.add_argument("--clips", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, nargs="+", default=[], metavar="DIR",
                        help="other checkouts of shardspeed, each run as its own tree (named by its folder)")  # fmt: skip
    parser.add_argument("--name", default="paired_steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    settings = dict(model=args.model, systems=args.systems, clips=args.clips, steps=args.steps,
                    warmup=args.warmup, jobs=args.jobs)  # fmt: skip
    trees = {"this": None, **{tree.resolve().name: str(tree.resolve()) for tree in args.baseline_tree}}
    jobs: dict[str, list[dict]] = {name: [] for name in trees}
    loads = [os.getloadavg()[0]]
    for j in range(args.jobs):
        for name, tree in trees.items():
            jobs[name].append(_job(settings, tree))
            loads.append(os.getloadavg()[0])
            print(f"job {j + 1}/{args.jobs} ({name}) done, load {loads[-1]:.1f}", flush=True)
    libraries = {name: tree_jobs[0]["library"] for name, tree_jobs in jobs.items()}
    result = {"settings": settings, "trees": libraries, "load": {"min": min(loads), "max": max(loads)},
              "rows": summarize(jobs), "jobs": jobs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
