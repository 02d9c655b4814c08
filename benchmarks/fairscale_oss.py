"""OSS + ShardedDataParallel beside FairScale: step time and peak memory on 2 CPU ranks, interleaved rounds.

    python benchmarks/fairscale_oss.py --fairscale-python /venvs/fs/bin/python [--rounds 5]

The same script, written against FairScale's API (`from fairscale.optim.oss import OSS`), runs under two
interpreters: one with FairScale 0.4.13 installed, one with shardspeed behind the `fairscale` alias (staged
on its PYTHONPATH by this script). Each round starts both jobs one after the other (the order alternates by
round), each job 2 ranks over Gloo (torch.distributed.run), so machine noise falls on both. Per job: an MLP
(`--width`, `--layers`), Adam, `--warmup` untimed steps then `--steps` timed ones; rank 0 reports the median
step time, and every rank its peak resident memory (ru_maxrss) and its growth over the memory held after
the model was built (the training state: gradients, optimizer state, communication buffers). Results:
benchmarks/results/fairscale_oss.{json,md}, with the shardspeed/FairScale ratio per round and its median,
min and max.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALIAS = ROOT / "integrations" / "fairscale-alias"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim.oss import OSS
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    built_mb = _rss_mb()
    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-4)
    model = ShardedDataParallel(model, optimizer)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        started = time.perf_counter()
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = torch.tensor([statistics.median(times), peak_mb, peak_mb - built_mb], dtype=torch.float64)
    gathered = [torch.zeros_like(report) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, report)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "step_s": gathered[0][0].item(),
            "peak_rss_mb": max(g[1].item() for g in gathered),
            "training_growth_mb": max(g[2].item() for g in gathered),
        }))  # fmt: skip
    dist.destroy_process_group()


def _stage_alias(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "fairscale"
    if not link.exists():
        link.symlink_to(ALIAS / "fairscale", target_is_directory=True)
    return folder


def run_job(side: str, python: str, args, tmp: Path, port: int) -> dict:
    out = tmp / f"{side}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSPEED_")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = f"{_stage_alias(tmp / 'alias')}{os.pathsep}{ROOT}" if side == "shardspeed" else ""
    command = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), __file__, "--worker", "--out", str(out), "--width", str(args.width),
               "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{side} job failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def render(results: dict) -> str:
    meta, summary = results["meta"], results["summary"]
    lines = [
        "# OSS + ShardedDataParallel beside FairScale (2 CPU ranks)",
        "",
        f"MLP of {meta['layers']} Linear({meta['width']}, {meta['width']}) layers ({meta['params'] / 1e6:.1f} M "
        f"parameters), batch {meta['batch']} per rank, Adam, fp32; {meta['warmup']} warm-up and {meta['steps']} "
        f"timed steps per job; {meta['rounds']} interleaved rounds. FairScale {meta['fairscale']} vs shardspeed "
        f"through the `fairscale` alias, the same script. Machine: {meta['machine']}. Run: {meta['date']}.",
        "",
        *([meta["note"], ""] if meta.get("note") else []),
        "| round | FairScale step (ms) | shardspeed step (ms) | ratio | FairScale peak RSS (MB) | shardspeed "
        "peak RSS (MB) | FairScale training growth (MB) | shardspeed training growth (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results["rounds"]):
        f, s = r["fairscale"], r["shardspeed"]
        lines.append(f"| {i} | {f['step_s'] * 1e3:.1f} | {s['step_s'] * 1e3:.1f} | {s['step_s'] / f['step_s']:.2f} | "
                     f"{f['peak_rss_mb']:.0f} | {s['peak_rss_mb']:.0f} | {f['training_growth_mb']:.0f} | "
                     f"{s['training_growth_mb']:.0f} |")  # fmt: skip
    for key, label in (
        ("step_ratio", "step time"),
        ("peak_ratio", "peak RSS"),
        ("growth_ratio", "training growth"),
    ):
        v = summary[key]
        lines.append("")
        lines.append(
            f"shardspeed / FairScale {label}: median {v['median']:.2f} (min {v['min']:.2f}, max {v['max']:.2f})"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--fairscale-python")
    parser.add_argument("--shardspeed-python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores (shared), {platform.platform()}")
    parser.add_argument("--note", default="", help="what else ran on the machine, for the record")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.fairscale_python:
        parser.error("--fairscale-python is required")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="fs-bench-") as tmp:
        for index in range(args.rounds):
            order = ("fairscale", "shardspeed") if index % 2 == 0 else ("shardspeed", "fairscale")
            result = {}
            for side in order:
                python = args.fairscale_python if side == "fairscale" else args.shardspeed_python
                result[side] = run_job(side, python, args, Path(tmp), free_port())
            rounds.append(result)
            print(f"round {index}: {json.dumps(result)}", flush=True)
    ratio = lambda key: _spread([r["shardspeed"][key] / r["fairscale"][key] for r in rounds])  # noqa: E731
    version = subprocess.run([args.fairscale_python, "-c", "import fairscale; print(fairscale.__version__)"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    results = {
        "meta": {"width": args.width, "layers": args.layers, "batch": args.batch, "steps": args.steps,
                 "warmup": args.warmup, "rounds": args.rounds, "machine": args.machine, "fairscale": version,
                 "params": args.layers * (args.width * args.width + args.width),
                 "date": datetime.date.today().isoformat(), "note": args.note},
        "rounds": rounds,
        "summary": {"step_ratio": ratio("step_s"), "peak_ratio": ratio("peak_rss_mb"),
                    "growth_ratio": ratio("training_growth_mb")},
    }  # fmt: skip
    out = Path(args.out)
    (out / "fairscale_oss.json").write_text(json.dumps(results, indent=1))
    (out / "fairscale_oss.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
