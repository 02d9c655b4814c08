"""Long-run stability: a 2,000-step run at each ZeRO stage, resident memory sampled per rank, loss checked.

    python benchmarks/long_run.py                      # stages 0-3, 2 ranks, 2000 steps, sample every 100
    python benchmarks/long_run.py --stages 2 --steps 300 --out /tmp/long_run

Each stage is one job through the `shardspeed` launcher (this file is also the rank script, with
--rank-job). Every rank samples its RSS (/proc/self/status VmRSS) every --every steps. The verdict per
stage: loss finite at every step, and RSS growth from the end of warm-up (--warmup steps) to the last
sample within --max-growth-mib on every rank. Writes <out>/long_run.md and <out>/long_run.json
(default benchmarks/results/) and exits 1 if a stage fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rank_job(args: argparse.Namespace) -> None:
    import shardspeed as deepspeed  # isort: skip
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = torch.Generator().manual_seed(1000 + engine.global_rank)
    target = torch.nn.Linear(32, 32)  # a fixed function to learn, the same on every rank
    samples, losses, nonfinite = [], [], 0
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        x = torch.randn(8, 32, generator=data)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        value = loss.item()
        nonfinite += not math.isfinite(value)
        if step % args.every == 0 or step == 1:
            samples.append({"step": step, "rss_mib": round(rss_mib(), 2)})
            losses.append({"step": step, "loss": value})
    result = {"rank": engine.global_rank, "stage": args.stage, "steps": args.steps, "samples": samples,
              "losses": losses, "nonfinite_steps": nonfinite, "seconds": time.monotonic() - started}  # fmt: skip
    Path(args.rank_out, f"stage{args.stage}_rank{engine.global_rank}.json").write_text(json.dumps(result))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_stage(args: argparse.Namespace, stage: int, rank_out: Path) -> list[dict]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "shardspeed.launcher.runner", "--num_gpus", str(args.ranks),
               "--master_port", str(free_port()), __file__, "--rank-job", "--stage", str(stage),
               "--steps", str(args.steps), "--every", str(args.every), "--rank-out", str(rank_out)]  # fmt: skip
    proc = subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.stage_timeout
    )
    if proc.returncode != 0:
        raise SystemExit(f"stage {stage} job failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(rank_out.glob(f"stage{stage}_rank*.json"))]


def verdict(ranks: list[dict], warmup: int, max_growth: float) -> dict:
    rows = []
    for r in ranks:
        after = [s for s in r["samples"] if s["step"] >= warmup]
        warm, end = after[0]["rss_mib"], after[-1]["rss_mib"]
        spread = max(s["rss_mib"] for s in after) - min(s["rss_mib"] for s in after)
        second_half = [s for s in after if s["step"] >= r["steps"] // 2]
        late = second_half[-1]["rss_mib"] - second_half[0]["rss_mib"]
        rows.append({"rank": r["rank"], "rss_after_warmup_mib": warm, "rss_end_mib": end,
                     "growth_mib": round(end - warm, 2), "spread_after_warmup_mib": round(spread, 2),
                     "growth_second_half_mib": round(late, 2),
                     "first_loss": r["losses"][0]["loss"], "last_loss": r["losses"][-1]["loss"],
                     "nonfinite_steps": r["nonfinite_steps"], "seconds": round(r["seconds"], 1),
                     "rss_series_mib": [[s["step"], s["rss_mib"]] for s in r["samples"]]})  # fmt: skip
    ok = all(row["growth_mib"] <= max_growth and row["nonfinite_steps"] == 0 for row in rows)
    return {"ok": ok, "ranks": rows}


def write_report(out: Path, args: argparse.Namespace, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    fr = os.environ.get("TORCH_FR_BUFFER_SIZE")
    lines = [
        "# Long-run stability",
        "",
        f"`{'TORCH_FR_BUFFER_SIZE=' + fr + ' ' if fr else ''}python benchmarks/long_run.py --stages "
        f"{' '.join(results['stages'])} --steps {args.steps} --every {args.every} --warmup {args.warmup}` "
        f"({args.ranks} ranks on CPU/Gloo, an MLP of 8.4k parameters, AdamW + WarmupLR + clipping). RSS per rank "
        f"after warm-up (step {args.warmup}) and at the last step; a stage passes when no rank grows by more "
        f"than {args.max_growth_mib} MiB and every loss is finite.",
        "",
        "| stage | rank | RSS after warm-up (MiB) | RSS at end (MiB) | growth (MiB) | growth in the second half (MiB) "
        "| loss first -> last | non-finite steps | seconds | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, result in results["stages"].items():
        for row in result["ranks"]:
            lines.append(
                f"| {stage} | {row['rank']} | {row['rss_after_warmup_mib']:.1f} | {row['rss_end_mib']:.1f} | "
                f"{row['growth_mib']:+.1f} | {row['growth_second_half_mib']:+.1f} | "
                f"{row['first_loss']:.4f} -> {row['last_loss']:.4f} | {row['nonfinite_steps']} | "
                f"{row['seconds']} | {'pass' if result['ok'] else 'FAIL'} |"
            )
    lines += ["", f"Run {results['date']} UTC, torch {results['torch']}, Python {results['python']}."]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--max-growth-mib", type=float, default=8.0)
    p.add_argument("--stage-timeout", type=float, default=1200.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="long_run", help="report file name (without .md/.json)")
    p.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_job:
        rank_job(args)
        return 0
    import tempfile

    import torch

    results = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "torch": torch.__version__,
               "python": sys.version.split()[0], "steps": args.steps, "ranks": args.ranks, "stages": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            result = verdict(run_stage(args, stage, Path(tmp)), args.warmup, args.max_growth_mib)
            results["stages"][str(stage)] = result
            growth = ", ".join(f"rank {r['rank']} {r['growth_mib']:+.1f} MiB" for r in result["ranks"])
            print(
                f"stage {stage}: {'pass' if result['ok'] else 'FAIL'} (RSS growth after warm-up: {growth})",
                flush=True,
            )
    write_report(Path(args.out), args, results)
    return 0 if all(r["ok"] for r in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
