"""Pipeline parallelism: bubble fraction against theory, throughput against torch's Schedule1F1B, peak
activation memory per stage.

    python benchmarks/pipeline.py --stages 2 4 --micro-batches 1 2 4 8 16 --steps 4 --out benchmarks/results

A GPT (embedding, transformer blocks, head) is split into p stages, one rank per stage, one thread per rank
(Gloo on loopback). For every micro-batch count m, the same model (same seeds, same partition bounds) trains
on the same batches with

- `shardspeed`: `PipelineModule` + `initialize` + `train_batch` (1F1B), AdamW;
- `torch-1f1b`: `torch.distributed.pipelining.PipelineStage` + `Schedule1F1B`, AdamW stepped after it.

Both run interleaved in one process group. Reported per (p, m): the median time of a global batch of
m micro-batches and samples/s; for shardspeed, the measured bubble — the fraction of the schedule's wall
time (from the stages' common start to the last backward) that a stage spends outside its own forward and
backward passes, averaged over stages — next to the ideal 1F1B bubble (p - 1) / (m + p - 1); and for both,
the peak bytes held for backward per stage (tensors saved by autograd, counted by a saved-tensors hook).
DeepSpeed's PipelineEngine is not in the table (see benchmarks/README.md).
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


def run_shardspeed(stages: int, m: int, steps: int) -> dict:
    import shardspeed
    from shardspeed.pipe import PipelineModule

    model = PipelineModule(layer_specs(), num_stages=stages, loss_fn=loss_fn, seed_layers=True)
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


def run_torch(stages: int, m: int, steps: int, parts: list[int]) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = dist.get_rank()
    specs = layer_specs()
    layers = []
    for index in range(parts[rank], parts[rank + 1]):
        torch.manual_seed(1234 + index)  # PipelineModule's seed_layers
        layers.append(specs[index].build())
    submodule = nn.Sequential(*layers)
    # Static shapes: torch's own shape inference exchanges pickled objects, which needs NumPy (not installed).
    hidden = torch.empty(MICRO, SEQ, DIM, requires_grad=True)
    example_in = torch.zeros(MICRO, SEQ, dtype=torch.long) if rank == 0 else hidden
    example_out = torch.empty(MICRO, SEQ, VOCAB, requires_grad=True) if rank == stages - 1 else hidden
    stage = PipelineStage(submodule, rank, stages, torch.device("cpu"), input_args=example_in,
                          output_args=example_out)  # fmt: skip
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(submodule.parameters(), lr=1e-3)
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


def worker(rank: int, world: int, port: int, micro_batches: list[int], steps: int, out_queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import traceback

    import shardspeed

    shardspeed.init_distributed()
    results = []
    try:
        for m in micro_batches:
            ours = run_shardspeed(world, m, steps)
            # Schedule1F1B refuses fewer micro-batches than stages
            theirs = run_torch(world, m, steps, ours["parts"]) if m >= world else None
            results.append({"m": m, "shardspeed": ours, "torch-1f1b": theirs})
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
    return summarise(stages, [per_rank[r] for r in range(stages)])


def summarise(stages: int, per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for i, m in enumerate(r["m"] for r in per_rank[0]):
        ours = [per_rank[s][i]["shardspeed"] for s in range(stages)]
        theirs = [per_rank[s][i]["torch-1f1b"] for s in range(stages)]
        bubbles = []
        for step in range(len(ours[0]["windows"])):
            start = min(o["windows"][step][0] for o in ours)
            end = max(o["windows"][step][1] for o in ours)
            bubbles.append(statistics.mean(1 - o["windows"][step][2] / (end - start) for o in ours))
        # a batch is done when its slowest stage is
        ours_time = statistics.median(max(o["times"][k] for o in ours) for k in range(len(ours[0]["times"])))
        theirs_time = None
        if theirs[0] is not None:
            theirs_time = statistics.median(
                max(t["times"][k] for t in theirs) for k in range(len(theirs[0]["times"]))
            )
        rows.append({
            "stages": stages, "m": m, "bubble_measured": statistics.median(bubbles),
            "bubble_theory": (stages - 1) / (m + stages - 1),
            "shardspeed_s": ours_time, "torch_s": theirs_time,
            "shardspeed_samples_s": m * MICRO / ours_time,
            "torch_samples_s": m * MICRO / theirs_time if theirs_time else None,
            "shardspeed_peak_saved_mib": [o["peak_saved"] / 2**20 for o in ours],
            "torch_peak_saved_mib": [t["peak_saved"] / 2**20 if t else None for t in theirs],
            "loss": (ours[-1]["loss"], theirs[-1]["loss"] if theirs[-1] else None), "parts": ours[0]["parts"],
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| p | m | bubble measured | bubble (p-1)/(m+p-1) | shardspeed samples/s | torch Schedule1F1B samples/s "
        "| ratio | peak saved MiB per stage (shardspeed / torch) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        torch_ok = r["torch_samples_s"] is not None
        peaks = " ".join(
            f"{a:.1f}/{b:.1f}" if b is not None else f"{a:.1f}/-"
            for a, b in zip(r["shardspeed_peak_saved_mib"], r["torch_peak_saved_mib"])
        )
        theirs = f"{r['torch_samples_s']:.1f}" if torch_ok else "n/a (needs m >= p)"
        ratio = f"{r['shardspeed_samples_s'] / r['torch_samples_s']:.2f}x" if torch_ok else "-"
        lines.append(
            f"| {r['stages']} | {r['m']} | {r['bubble_measured']:.2f} | {r['bubble_theory']:.2f} | "
            f"{r['shardspeed_samples_s']:.1f} | {theirs} | {ratio} | {peaks} |"
        )
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
