"""Evoformer attention: DS4Sci_EvoformerAttention against the plain reference (and SDPA on a GPU).

    python benchmarks/evoformer.py                    # CPU: the grid, the target case, the block's largest n_res
    python benchmarks/evoformer.py --device cuda      # GPU: the same next to scaled_dot_product_attention
    python benchmarks/evoformer.py --quick --out /tmp/evoformer

1. Forward + backward of the attention alone (Q, K, V [1, n_seq, n_res, 4, 32], a mask bias and a pair bias,
   all requiring grad) over a grid of (n_seq, n_res): peak memory of each system and its time, interleaved
   rounds, ratios to the plain reference. The issue's target: at n_seq 32, n_res 256 ours peaks at <= 0.3x
   the plain reference's memory and takes <= 1.5x its time on the CPU.
2. The largest n_res at which one block of examples/evoformer/model.py (n_seq 16) trains (forward +
   backward, fp32) within a fixed memory budget, with its attentions on DS4Sci_EvoformerAttention and on
   the plain reference: n_res rises through a list until the step's peak passes the budget.

How memory is measured is in benchmarks/evoformer_cases.py. CPU results go to
benchmarks/results/evoformer.{md,json}, CUDA ones to evoformer_cuda.{md,json}. The CUDA run needs only
torch (no NumPy, nothing compiled) and takes well under 3 minutes on one recent GPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from queue import Empty

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import evoformer_cases as cases  # noqa: E402
from benchmarks.evoformer_gpu import run_device  # noqa: E402

HEADS, DIM = 4, 32
TARGET = (32, 256)
GRID = {"cpu": [(8, 128), (32, 128), TARGET, (64, 256), (16, 512)], "quick": [(4, 64), (8, 96)]}
BLOCK = {"n_seq": 16, "model": {"c_m": 32, "c_z": 16, "c_hidden": 8, "heads_msa": 4, "heads_pair": 2}}
BLOCK_N_RES = [32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768]
QUICK_N_RES = [16, 24, 32, 48]


def run_child(target, case: dict, timeout: float = 1800) -> dict:
    """`target(case, queue)` in a fresh spawned process; its answer, or how it failed (a child that dies,
    e.g. killed for memory, is noticed within a second; one past `timeout` is killed)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(case, queue))
    proc.start()
    deadline = time.monotonic() + timeout
    result = None
    while result is None:
        try:
            result = queue.get(timeout=1)
        except Empty:
            if not proc.is_alive() and queue.empty():
                result = {"error": f"child exited with {proc.exitcode}"}
            elif time.monotonic() > deadline:
                proc.kill()
                result = {"error": f"no answer in {timeout:.0f} s"}
    proc.join(timeout=60)
    return result


def ratio_summary(ours: list[float], base: list[float]) -> dict:
    per_round = [a / b for a, b in zip(ours, base)]
    return {"median": cases.median(per_round), "min": min(per_round), "max": max(per_round)}


def grid_case(n_seq: int, n_res: int, args) -> dict:
    case = {"n_seq": n_seq, "n_res": n_res, "heads": HEADS, "dim": DIM, "threads": args.threads}
    row = {"n_seq": n_seq, "n_res": n_res, "logits_mib": cases.logits_mib(n_seq, n_res, HEADS), "memory": {}}
    for system in ("plain", "ours"):
        row["memory"][system] = run_child(cases.cpu_memory, {**case, "system": system})
    times = run_child(cases.cpu_timing, {**case, "systems": ["plain", "ours"], "rounds": args.rounds})
    row["seconds"] = times
    if "error" not in times:
        row["time_ratio"] = ratio_summary(times["ours"], times["plain"])
    return row


def largest_n_res(attention: str, n_res_list: list[int], budget_mib: float, args) -> dict:
    """Climb n_res until one training step of the block peaks over the budget."""
    steps = []
    for n_res in n_res_list:
        case = {**BLOCK, "n_res": n_res, "attention": attention, "threads": args.threads}
        result = {"n_res": n_res, **run_child(cases.block_step_memory, case)}
        steps.append(result)
        if "error" in result or result["rss_mib"] > budget_mib:
            break
    fits = [s for s in steps if "error" not in s and s["rss_mib"] <= budget_mib]
    return {"attention": attention, "largest": fits[-1] if fits else None, "steps": steps}


def _fmt_range(values: list[float], scale: float = 1e3) -> str:
    return f"{cases.median(values) * scale:.0f} [{min(values) * scale:.0f}-{max(values) * scale:.0f}]"


def render_cpu(result: dict) -> list[str]:
    lines = [
        f"Forward + backward of Evoformer attention, Q/K/V [1, n_seq, n_res, {HEADS}, {DIM}], mask + pair bias, "
        f"fp32, CPU, {result['threads']} thread(s) per process; {result['rounds']} interleaved rounds. Memory: "
        "peak above the inputs, allocator-tracked (exact) and VmHWM (RSS); see benchmarks/evoformer_cases.py.",
        "",
        "| n_seq | n_res | whole logits (MiB) | plain peak MiB (tracked / RSS) | ours peak MiB (tracked / RSS) "
        "| ours / plain memory (tracked / RSS) | plain ms, median [min-max] | ours ms | ours / plain time, median [min-max] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["grid"]:
        plain, ours = row["memory"]["plain"], row["memory"]["ours"]
        if "error" in plain or "error" in ours or "time_ratio" not in row:
            lines.append(f"| {row['n_seq']} | {row['n_res']} | failed: {plain} {ours} |")
            continue
        t, r = row["seconds"], row["time_ratio"]
        lines.append(
            f"| {row['n_seq']} | {row['n_res']} | {row['logits_mib']:.0f} | {plain['tracked_mib']:.1f} / "
            f"{plain['rss_mib']:.1f} | {ours['tracked_mib']:.1f} / {ours['rss_mib']:.1f} | "
            f"**{ours['tracked_mib'] / plain['tracked_mib']:.2f}x** / {ours['rss_mib'] / plain['rss_mib']:.2f}x | "
            f"{_fmt_range(t['plain'])} | {_fmt_range(t['ours'])} | **{r['median']:.2f}x** "
            f"[{r['min']:.2f}-{r['max']:.2f}] |"
        )
    lines += ["", *render_target(result), "", *render_block(result, "RSS")]
    lines += ["", f"Machine: {result['machine']}; load average before {result['load_before']}, "
              f"after {result['load_after']}."]  # fmt: skip
    return lines


def render_target(result: dict) -> list[str]:
    row = next((r for r in result["grid"] if (r["n_seq"], r["n_res"]) == TARGET and "time_ratio" in r), None)
    if row is None:
        return [f"Target case n_seq {TARGET[0]}, n_res {TARGET[1]} not in this run."]
    memory = row["memory"]["ours"]["tracked_mib"] / row["memory"]["plain"]["tracked_mib"]
    rss = row["memory"]["ours"]["rss_mib"] / row["memory"]["plain"]["rss_mib"]
    time_ratio = row["time_ratio"]["median"]
    return [
        f"Target (n_seq {TARGET[0]}, n_res {TARGET[1]}, heads {HEADS}, dim {DIM}): memory {memory:.2f}x tracked / "
        f"{rss:.2f}x RSS (<= 0.3x: {'met' if max(memory, rss) <= 0.3 else 'not met'}), time {time_ratio:.2f}x "
        f"(<= 1.5x: {'met' if time_ratio <= 1.5 else 'not met'})."
    ]


def render_block(result: dict, how: str) -> list[str]:
    block = result["block"]
    lines = [
        f"One block of examples/evoformer/model.py (n_seq {BLOCK['n_seq']}, {BLOCK['model']}), forward + "
        f"backward, fp32: the largest n_res whose step peaks within {block['budget_mib']:.0f} MiB ({how} above "
        "the model and batch; gradients included).",
        "",
        "| attention | largest n_res within the budget | its peak (MiB) | its step (s) | next n_res tried: peak (MiB) |",
        "|---|---|---|---|---|",
    ]
    for entry in block["runs"]:
        best, last = entry["largest"], entry["steps"][-1]
        over = "-" if best is not None and last is best else (
            f"{last['n_res']}: {last.get('rss_mib', last.get('peak_mib', float('nan'))):.0f}"
            if "error" not in last else f"{last['n_res']}: {last['error']}"
        )  # fmt: skip
        if best is None:
            lines.append(f"| {entry['attention']} | none | - | - | {over} |")
            continue
        peak = best.get("rss_mib", best.get("peak_mib"))
        lines.append(
            f"| {entry['attention']} | **{best['n_res']}** | {peak:.0f} | {best['seconds']:.2f} | {over} |"
        )
    largest = {e["attention"]: e["largest"]["n_res"] for e in block["runs"] if e["largest"] is not None}
    if len(largest) == 2:
        lines += [
            "",
            f"Largest n_res, DS4Sci_EvoformerAttention / plain: {largest['evoformer'] / largest['plain']:.2f}x.",
        ]
    return lines


def _machine(device: str) -> str:
    import platform

    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_cpu(args) -> dict:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned children
    result = {"device": "cpu", "threads": args.threads, "rounds": args.rounds, "machine": _machine("cpu"),
              "load_before": _load()}  # fmt: skip
    grid = GRID["quick"] if args.quick else GRID["cpu"]
    result["grid"] = [grid_case(n_seq, n_res, args) for n_seq, n_res in grid]
    n_res_list = QUICK_N_RES if args.quick else BLOCK_N_RES
    runs = [
        largest_n_res(attention, n_res_list, args.budget_mib, args) for attention in ("plain", "evoformer")
    ]
    result["block"] = {"budget_mib": args.budget_mib, "runs": runs}
    result["load_after"] = _load()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU process")
    parser.add_argument(
        "--budget-mib", type=float, default=None, help="block memory budget (CPU 1024, CUDA 8192)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny grid and n_res list: checks the code path")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    args = parser.parse_args(argv)
    if args.budget_mib is None:
        args.budget_mib = (
            (64 if args.quick else 1024) if args.device == "cpu" else (256 if args.quick else 8192)
        )
    if args.device == "cuda":
        result, lines = run_device(args, "cuda")
        name = "evoformer_cuda"
    else:
        result = run_cpu(args)
        lines = render_cpu(result)
        name = "evoformer"
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
