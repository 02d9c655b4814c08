"""Peak memory of one training step (forward + backward) with activation checkpointing, per configuration.

    python benchmarks/activation_checkpointing.py                  # 12-block MLP, dim 512, batch 4096
    python benchmarks/activation_checkpointing.py --dim 256 --batch 1024 --out /tmp/ac

The model is 12 residual MLP blocks (Linear d->4d, GELU, Linear 4d->d) on a batch of 4096 rows, fp32 on the
CPU. Each configuration runs in a fresh spawned process: it builds the model and input, runs one warm-up
step, resets the kernel's peak-RSS mark (`echo 5 > /proc/self/clear_refs` resets VmHWM), runs one more step
and reads VmHWM. Reported: the peak RSS of the step above the RSS before it (parameters, the input and the
warm-up's gradient buffers are in that baseline), and the ratio to the plain run. glibc is told to serve
every allocation above 64 KiB by mmap (MALLOC_MMAP_THRESHOLD_), so freed activations leave RSS at once and
the peak is the true high-water mark of live tensors, not of the malloc heap.

Checkpointing wraps each block (`checkpoint(block, h)`); the anchors are torch.utils.checkpoint in its two
forms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

CONFIGS = {
    "plain": "no checkpointing",
    "torch-reentrant": "torch.utils.checkpoint(use_reentrant=True)",
    "torch-non-reentrant": "torch.utils.checkpoint(use_reentrant=False)",
    "checkpoint": "shardspeed.checkpointing.checkpoint",
    "non_reentrant_checkpoint": "shardspeed.checkpointing.non_reentrant_checkpoint",
    "checkpoint+contiguous": "checkpoint, contiguous_memory_optimization (12 buffers)",
    "checkpoint+cpu": "checkpoint, cpu_checkpointing (no-op on a CPU run)",
}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _wrapper(name: str):
    import torch.utils.checkpoint as tc

    from shardspeed import checkpointing

    if name == "plain":
        return lambda block, h: block(h)
    if name.startswith("torch-"):
        reentrant = name == "torch-reentrant"
        return lambda block, h: tc.checkpoint(block, h, use_reentrant=reentrant)
    if name == "checkpoint+contiguous":
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=12)
    if name == "checkpoint+cpu":
        checkpointing.configure(None, checkpoint_in_cpu=True)
    api = (
        checkpointing.non_reentrant_checkpoint
        if name == "non_reentrant_checkpoint"
        else checkpointing.checkpoint
    )
    return lambda block, h: api(block, h)


def _measure(name: str, dim: int, batch: int, layers: int, queue) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(2)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            return x + self.net(x)

    blocks = nn.ModuleList(Block() for _ in range(layers))
    x = torch.randn(batch, dim, requires_grad=True)
    wrap = _wrapper(name)

    def step() -> float:
        h = x
        for block in blocks:
            h = wrap(block, h)
        loss = h.pow(2).mean()
        loss.backward()
        return loss.item()

    step()  # warm-up: gradient buffers exist from here on, as in training
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    loss = step()
    peak = _status_kib("VmHWM")
    queue.put({"config": name, "peak_step_mib": (peak - baseline) / 1024, "peak_rss_mib": peak / 1024,
               "loss": loss})  # fmt: skip


def _ratio(row: dict, plain: dict | None, key: str) -> str:
    return f"{row[key] / plain[key]:.2f}x" if plain and plain[key] > 0 else "-"


def render(rows: list[dict], layers: int, dim: int, batch: int) -> list[str]:
    """The markdown table (and its notes) for the measured rows."""
    plain = next((r for r in rows if r["config"] == "plain"), None)
    lines = [
        f"Peak memory of one forward+backward step: {layers}-block MLP, dim {dim}, batch {batch}, fp32, CPU "
        "(VmHWM above the RSS before the step; see the module docstring).",
        "",
        "| configuration | what | peak above baseline (MiB) | x plain | peak RSS of the process (MiB) | x plain | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = _ratio(r, plain, "peak_step_mib")
        rss = _ratio(r, plain, "peak_rss_mib")
        lines.append(f"| {r['config']} | {CONFIGS[r['config']]} | {r['peak_step_mib']:.0f} | {step} | "
                     f"{r['peak_rss_mib']:.0f} | {rss} | {r['loss']:.6f} |")  # fmt: skip
    lines += [
        "",
        "checkpoint+contiguous keeps its buffers (one block input each, 12 x batch x dim x 4 bytes) from the",
        "warm-up step on, so they sit in its baseline: compare it on the whole-process column. Equal losses:",
        "every configuration computes the same step.",
    ]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned processes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    ctx = mp.get_context("spawn")
    rows = []
    for name in args.configs:
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(name, args.dim, args.batch, args.layers, queue))
        proc.start()
        rows.append(queue.get(timeout=900))
        proc.join()
    lines = render(rows, args.layers, args.dim, args.batch)
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "activation_checkpointing.md").write_text(table + "\n")
    (out / "activation_checkpointing.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
