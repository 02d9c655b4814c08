"""Where a system's step time goes: phase times (forward+backward, optimizer step) and torch.profiler's top ops.

    python benchmarks/profile_step.py --model small --systems one-process shardspeed-z0 ddp --steps 10

Runs each system in fresh spawned ranks like the suite, times `backward(batch)` and `step()` separately on
every rank, and prints rank 0's torch.profiler table (self CPU time) for the last `--steps` steps.
For Python-level detail, run py-spy on a rank: `py-spy record --pid <rank pid> --native`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import worker
from benchmarks.models import MODELS, Hyper
from benchmarks.systems import BASELINE_TREE_ENV


def profile_steps(job: worker.JobSpec, trainer, batches) -> dict:
    from torch.profiler import ProfilerActivity, profile

    phases = {"forward+backward": [], "step": []}
    for i in range(job.warmup):
        trainer.backward(batches[i % len(batches)])
        trainer.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(job.steps):
            t0 = time.perf_counter()
            loss = trainer.backward(batches[i % len(batches)])
            t1 = time.perf_counter()
            trainer.step()
            loss.item()
            phases["forward+backward"].append(t1 - t0)
            phases["step"].append(time.perf_counter() - t1)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
    return {"phases": {k: statistics.median(v) for k, v in phases.items()}, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--systems", nargs="+", default=["one-process", "shardspeed-z0", "ddp"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--adam", choices=["fused", "foreach", "loop"], default="fused")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient clipping in every system (0: off)")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="checkout for the baseline-z* rows")
    args = parser.parse_args()
    if args.baseline_tree is not None:
        os.environ[BASELINE_TREE_ENV] = str(args.baseline_tree.resolve())
    for name in args.systems:
        micro = MODELS[args.model].micro_batch
        hyper = Hyper(impl=args.adam, max_grad_norm=args.clip)
        job = worker.JobSpec(name, args.model, micro, args.steps, args.warmup, hyper=hyper, profile=True)
        status, out = worker.run_job(job)
        if status != "ok":
            print(f"== {name}: {status}: {str(out)[-500:]}")
            continue
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out[0]["phases"].items())
        print(f"== {name} (rank 0 medians): {phases}\n{out[0]['table']}")


if __name__ == "__main__":
    main()
