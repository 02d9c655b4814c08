"""Pipeline parallelism: bubble fraction against theory, throughput against torch's Schedule1F1B, peak
activation memory per stage.

    python benchmarks/pipeline.py --stages 2 4 --micro-batches 1 2 4 8 16 --steps 4 --out benchmarks/results

A GPT (embedding, transformer blocks, head) is split into p stages, one rank per stage, one thread per rank
(Gloo on loopback). For every micro-batch count m, the same model (same seeds, same partition bounds) trains
on the same batches with

- `shardspeed`: `PipelineModule` + `initialize` + `train_batch` (1F1B), AdamW;
- `shardspeed-v2`: the same with `virtual_stages=2` (interleaved 1F1B; 2p parts of the same layers);
- `torch-1f1b`: `torch.distributed.pipelining.PipelineStage` + `Schedule1F1B`, AdamW stepped after it;
- `torch-v2`: `ScheduleInterleaved1F1B` with two `PipelineStage`s per rank on the same 2p parts;
- `deepspeed`: DeepSpeed 0.19.8's `PipelineModule` + `PipelineEngine.train_batch` (`DS_ACCELERATOR=cpu`),
  when DeepSpeed is importable (run this script with the bench extra's interpreter; see the README there).

All run interleaved in one process group. Reported per (p, m): the median time of a global batch of
m micro-batches and samples/s; for shardspeed, the measured bubble — the fraction of the schedule's wall
time (from the stages' common start to the last backward) that a stage spends outside its own forward and
backward passes, averaged over stages — next to the ideal (p - 1) / (v m + p - 1) (v = 1: 1F1B); and the
peak bytes held for backward per stage (tensors saved by autograd, counted by a saved-tensors hook).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import Block

VOCAB, DIM, LAYERS, HEADS, SEQ, MICRO = 512, 192, 6, 6, 64, 4


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x):
        return self.out(self.ln(x))


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs():
    from shardspeed.pipe import LayerSpec

    return [LayerSpec(Embed)] + [LayerSpec(Block, DIM, HEADS) for _ in range(LAYERS)] + [LayerSpec(Head)]


class SavedBytes:
    """Bytes autograd holds for backward right now, and the peak (a saved-tensors hook; CPU has no allocator
    statistics). Each saved tensor is counted once per save, from pack until its graph is freed."""

    def __init__(self):
        self.live = self.peak = 0

    def hooks(self):
        meter = self

        class Held:
            def __init__(self, t):
                self.t, self.n = t, t.numel() * t.element_size()
                meter.live += self.n
                meter.peak = max(meter.peak, meter.live)

            def __del__(self):
                meter.live -= self.n

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.t)


def batches(m: int, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (m * MICRO, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def run_shardspeed(stages: int, m: int, steps: int, virtual: int = 1) -> dict:
    import shardspeed
    from shardspeed.pipe import PipelineModule

    model = PipelineModule(layer_specs(), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                           virtual_stages=virtual)  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, config=config)
    clock = {"busy": 0.0, "start": 0.0, "end": 0.0}

    def timed(fn):
        def run(state, mb):
            t0 = time.monotonic()
            fn(state, mb)
            clock["busy"] += time.monotonic() - t0
            clock["end"] = time.monotonic()

        return run

    def read_then_start(count, caller, _read=engine._read_batches):
        out = _read(count, caller)
        clock["start"] = time.monotonic()  # the stages leave this all-reduce together
        return out

    engine._exec_forward, engine._exec_backward = timed(engine._exec_forward), timed(engine._exec_backward)
    engine._read_batches = read_then_start
    meter, times, windows = SavedBytes(), [], []
    for step in range(steps + 1):
        x, y = batches(m, step)
        data = iter([(x[i * MICRO : (i + 1) * MICRO], y[i * MICRO : (i + 1) * MICRO]) for i in range(m)])
        clock.update(busy=0.0)
        t0 = time.monotonic()
        with meter.hooks():
            loss = engine.train_batch(data)
        if step:  # the first batch warms up (and negotiates shapes)
            times.append(time.monotonic() - t0)
            windows.append((clock["start"], clock["end"], clock["busy"]))
    engine.destroy()
    return {"times": times, "windows": windows, "peak_saved": meter.peak, "loss": loss.item(),
            "parts": model.parts}  # fmt: skip


def run_torch(stages: int, m: int, steps: int, parts: list[int], virtual: int = 1) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank = dist.get_rank()
    specs = layer_specs()
    hidden = torch.empty(MICRO, SEQ, DIM, requires_grad=True)
    pipeline_stages, params = [], []
    for part in range(rank, stages * virtual, stages):  # part q lives on rank q % stages, as in shardspeed
        layers = []
        for index in range(parts[part], parts[part + 1]):
            torch.manual_seed(1234 + index)  # PipelineModule's seed_layers
            layers.append(specs[index].build())
        submodule = nn.Sequential(*layers)
        params += list(submodule.parameters())
        # Static shapes: torch's own shape inference exchanges pickled objects, which needs NumPy.
        example_in = torch.zeros(MICRO, SEQ, dtype=torch.long) if part == 0 else hidden
        last = part == stages * virtual - 1
        example_out = torch.empty(MICRO, SEQ, VOCAB, requires_grad=True) if last else hidden
        pipeline_stages.append(PipelineStage(submodule, part, stages * virtual, torch.device("cpu"),
                                             input_args=example_in, output_args=example_out))  # fmt: skip
    if virtual == 1:
        schedule = Schedule1F1B(pipeline_stages[0], n_microbatches=m, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(pipeline_stages, n_microbatches=m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    meter, times, loss = SavedBytes(), [], None
    for step in range(steps + 1):
        x, y = batches(m, step)
        t0 = time.monotonic()
        with meter.hooks():
            losses = []
            if rank == 0:
                schedule.step(x)
            elif rank == stages - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        if losses:
            loss = torch.stack(losses).mean().item()
        if step:
            times.append(time.monotonic() - t0)
    return {"times": times, "peak_saved": meter.peak, "loss": loss}


def run_deepspeed(stages: int, m: int, steps: int) -> dict:
    """DeepSpeed's own PipelineModule (its LayerSpec, seed_layers with the same base seed) and train_batch."""
    import logging

    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group already there
    specs = [LayerSpec(Embed)] + [LayerSpec(Block, DIM, HEADS) for _ in range(LAYERS)] + [LayerSpec(Head)]
    # seed_fn: DeepSpeed's default seeding passes a NumPy integer to random.seed, which Python 3.11 refuses
    # (TypeError); the torch seed per layer is the same as shardspeed's seed_layers.
    model = PipelineModule(specs, num_stages=stages, loss_fn=loss_fn, seed_layers=True, base_seed=1234,
                           seed_fn=lambda seed: torch.manual_seed(int(seed)), partition_method="parameters")  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    meter, times, loss = SavedBytes(), [], None
    for step in range(steps + 1):
        x, y = batches(m, step)
        data = iter([(x[i * MICRO : (i + 1) * MICRO], y[i * MICRO : (i + 1) * MICRO]) for i in range(m)])
        t0 = time.monotonic()
        with meter.hooks():
            loss = engine.train_batch(data)
        if step:
            times.append(time.monotonic() - t0)
    return {
        "times": times,
        "peak_saved": meter.peak,
        "loss": float(loss),
        "parts": [int(b) for b in model.parts],
    }


def deepspeed_missing() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("deepspeed") is not None else "deepspeed not installed"


def worker(rank: int, world: int, port: int, micro_batches: list[int], steps: int, out_queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    import traceback

    import shardspeed

    shardspeed.init_distributed()
    results = []
    try:
        for m in micro_batches:
            row = {"m": m, "shardspeed": run_shardspeed(world, m, steps)}
            # Schedule1F1B refuses fewer micro-batches than stages; interleaving needs m a multiple of p
            row["torch-1f1b"] = run_torch(world, m, steps, row["shardspeed"]["parts"]) if m >= world else None
            interleave = m % world == 0 and m >= world
            row["shardspeed-v2"] = run_shardspeed(world, m, steps, virtual=2) if interleave else None
            row["torch-v2"] = (
                run_torch(world, m, steps, row["shardspeed-v2"]["parts"], virtual=2) if interleave else None
            )
            row["deepspeed"] = run_deepspeed(world, m, steps) if deepspeed_missing() is None else None
            results.append(row)
    except Exception:
        out_queue.put((rank, traceback.format_exc()))
        raise
    out_queue.put((rank, results))
    import torch.distributed as dist

    dist.destroy_process_group()


def run_stages(stages: int, micro_batches: list[int], steps: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, stages, port, micro_batches, steps, queue)) for r in range(stages)
    ]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=3600) for _ in procs)
    failed = [r for r, v in per_rank.items() if isinstance(v, str)]
    if failed:
        raise RuntimeError(f"rank {failed[0]} failed:\n{per_rank[failed[0]]}")
    for p in procs:
        p.join()
    from benchmarks.worker import remove_shared_memory_left_by  # DeepSpeed's /dev/shm files

    remove_shared_memory_left_by(port)
    return summarise(stages, [per_rank[r] for r in range(stages)])


def _batch_time(runs: list[dict]) -> float:
    """Median over timed batches of the slowest stage's time (a batch is done when its slowest stage is)."""
    return statistics.median(max(r["times"][k] for r in runs) for k in range(len(runs[0]["times"])))


def _bubble(runs: list[dict]) -> float:
    bubbles = []
    for step in range(len(runs[0]["windows"])):
        start = min(o["windows"][step][0] for o in runs)
        end = max(o["windows"][step][1] for o in runs)
        bubbles.append(statistics.mean(1 - o["windows"][step][2] / (end - start) for o in runs))
    return statistics.median(bubbles)


SYSTEMS = ("shardspeed", "shardspeed-v2", "torch-1f1b", "torch-v2", "deepspeed")


def summarise(stages: int, per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for i, m in enumerate(r["m"] for r in per_rank[0]):
        runs = {name: [per_rank[s][i][name] for s in range(stages)] for name in SYSTEMS}
        row = {"stages": stages, "m": m, "bubble_theory": (stages - 1) / (m + stages - 1),
               "bubble_theory_v2": (stages - 1) / (2 * m + stages - 1), "parts": runs["shardspeed"][0]["parts"]}  # fmt: skip
        for name, got in runs.items():
            if got[0] is None:
                row[f"{name}_samples_s"] = row[f"{name}_times_s"] = row[f"{name}_peak_saved_mib"] = None
                continue
            batch_times = [max(r["times"][k] for r in got) for k in range(len(got[0]["times"]))]
            row[f"{name}_samples_s"] = m * MICRO / _batch_time(got)
            row[f"{name}_times_s"] = [min(batch_times), statistics.median(batch_times), max(batch_times)]
            row[f"{name}_peak_saved_mib"] = [r["peak_saved"] / 2**20 for r in got]
            row[f"{name}_loss"] = got[-1]["loss"]
            if "windows" in got[0]:
                row[f"{name}_bubble"] = _bubble(got)
        if runs["deepspeed"][0] is not None:
            row["deepspeed_parts"] = runs["deepspeed"][0]["parts"]
        rows.append(row)
    return rows


def _ratio(row: dict, a: str, b: str) -> str:
    return (
        f"{row[a + '_samples_s'] / row[b + '_samples_s']:.2f}x"
        if row[a + "_samples_s"] and row[b + "_samples_s"]
        else "-"
    )


def _rate(row: dict, name: str) -> str:
    return f"{row[name + '_samples_s']:.1f}" if row[name + "_samples_s"] else "-"


def table(rows: list[dict]) -> str:
    lines = [
        "| p | m | bubble 1F1B (theory) | bubble v=2 (theory) | samples/s: shardspeed | shardspeed v=2 "
        "| torch 1F1B | torch interleaved v=2 | DeepSpeed | ours/torch 1F1B | ours/torch v=2 | ours/DeepSpeed "
        "| peak saved MiB per stage (shardspeed / torch / DeepSpeed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v2 = (
            f"{r['shardspeed-v2_bubble']:.2f} ({r['bubble_theory_v2']:.2f})"
            if r["shardspeed-v2_samples_s"]
            else "-"
        )
        peaks = " ".join(
            "/".join(f"{p[s]:.1f}" if p else "-" for p in (r["shardspeed_peak_saved_mib"], r["torch-1f1b_peak_saved_mib"],
                                                            r["deepspeed_peak_saved_mib"]))
            for s in range(r["stages"])
        )  # fmt: skip
        best = (
            "shardspeed-v2"
            if (r["shardspeed-v2_samples_s"] or 0) > r["shardspeed_samples_s"]
            else "shardspeed"
        )
        lines.append(
            f"| {r['stages']} | {r['m']} | {r['shardspeed_bubble']:.2f} ({r['bubble_theory']:.2f}) | {v2} | "
            f"{_rate(r, 'shardspeed')} | {_rate(r, 'shardspeed-v2')} | {_rate(r, 'torch-1f1b')} | {_rate(r, 'torch-v2')} | "
            f"{_rate(r, 'deepspeed')} | {_ratio(r, 'shardspeed', 'torch-1f1b')} | {_ratio(r, 'shardspeed-v2', 'torch-v2')} | "
            f"{_ratio(r, best, 'deepspeed')} | {peaks} |"
        )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--steps", type=int, default=4, help="timed batches per configuration (after 1 warm-up)"
    )
    parser.add_argument("--out", default=None, help="folder for pipeline.md and pipeline.json")
    args = parser.parse_args()
    rows = []
    for stages in args.stages:
        rows += run_stages(stages, args.micro_batches, args.steps)
        print(table(rows), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline.json").write_text(json.dumps(rows, indent=1))
        (out / "pipeline.md").write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
