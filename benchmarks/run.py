"""Run the benchmark suite from the command line and write benchmarks/results/<model>.{md,json,png}.

    python benchmarks/run.py --model small --rounds 3 --steps 20 --warmup 5 --systems all

`--systems` takes row names (one-process, no-comm-x2, shardspeed-z0..z3, shardspeed-offload, ddp,
zero-redundancy, fsdp2, deepspeed-z0..z3, baseline-z0..z3) or groups (all, shardspeed, torch, deepspeed,
baseline). The baseline rows run shardspeed from another checkout (`--baseline-tree`). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run.py`: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report
from benchmarks.models import MODELS
from benchmarks.suite import SuiteSpec, load_average, run_suite

RESULTS = Path(__file__).resolve().parent / "results"


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 30.0) -> float:
    """Poll the 1-minute load average until it is at most `max_load` (or give up after `max_wait_s`)."""
    deadline = time.monotonic() + max_wait_s
    load = load_average()
    while load > max_load and time.monotonic() < deadline:
        print(f"load average {load:.2f} > {max_load}: waiting {poll_s:.0f} s", flush=True)
        time.sleep(poll_s)
        load = load_average()
    return load


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--systems", nargs="+", default=["all"], help="row names or groups (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per job")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps per job before measuring")
    parser.add_argument("--micro-batch", type=int, default=None, help="per rank (default: the model's)")
    parser.add_argument("--adam", choices=["fused", "foreach", "loop"], default="fused",
                        help="torch AdamW kernel every system uses")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reduce-bucket-size", type=int, default=None, metavar="ELEMENTS",
                        help="zero_optimization.reduce_bucket_size for shardspeed and DeepSpeed (default: theirs)")  # fmt: skip
    parser.add_argument("--clip", type=float, default=0.0, metavar="MAX_NORM",
                        help="gradient clipping in every system: the engines' gradient_clipping, torch's "
                             "clip_grad_norm_ elsewhere (default 0: off)")  # fmt: skip
    parser.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                        help="a checkout of shardspeed (e.g. a worktree of an older commit) for the baseline-z* rows")  # fmt: skip
    parser.add_argument("--name", default=None, help="results file name (default: the model's)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--wait-load", type=float, default=None, metavar="LOAD",
                        help="before starting, wait (up to 10 min) for the 1-minute load to fall to LOAD")  # fmt: skip
    parser.add_argument("--quiet-gate", type=float, default=None, metavar="CORES",
                        help="before each job, wait (up to 3 min) until other processes use at most CORES cores")  # fmt: skip
    parser.add_argument("--update-readme", action="store_true",
                        help="refresh the table between this model's markers in benchmarks/README.md")  # fmt: skip
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.wait_load is not None:
        print(f"load average at start: {wait_for_quiet(args.wait_load, 600):.2f}", flush=True)
    spec = SuiteSpec(
        model=args.model, systems=args.systems, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
        micro_batch=args.micro_batch, seed=args.seed, adam=args.adam, quiet_gate=args.quiet_gate,
        reduce_bucket_size=args.reduce_bucket_size, max_grad_norm=args.clip,
        baseline_tree=str(args.baseline_tree.resolve()) if args.baseline_tree else None,
    )  # fmt: skip
    result = run_suite(spec, log=lambda line: print(line, flush=True))
    for path in report.write_all(result, args.out, plots=not args.no_plots, name=args.name):
        print(f"wrote {path}")
    if args.update_readme:
        report.update_readme(Path(__file__).resolve().parent / "README.md", result)
    print(report.table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
