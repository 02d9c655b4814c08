"""Steady-state model-state memory per rank, from RSS, against the ZeRO formula (issue: 50M params, fp32 Adam).

    python benchmarks/zero_memory.py --params 50e6 --world 2 --systems shardspeed deepspeed

Each (system, stage) runs in fresh spawned ranks. A rank records its RSS after start-up (torch imported,
process group up), builds a parameter-heavy MLP, trains three steps with Adam, frees what it can
(`gc.collect()` + glibc `malloc_trim(0)`, as in DeepSpeed's measurement) and records RSS again. The
difference is the model states plus whatever the system keeps between steps; it is compared with the
formula: stage 0 16Ψ, stage 1 (4+4+8/N)Ψ, stage 2 (4+12/N)Ψ, stage 3 16Ψ/N bytes, target within 5% + 32 MiB.
`shardspeed-nvme` adds `offload_optimizer: {device: nvme}` (stages 1-3): Adam's 8Ψ/N bytes of state move to
files, so its formula is 8Ψ/N lower.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package

import torch
from torch import nn

from harness import run_ranks

WIDTH = 2048


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _mlp(num_params: float) -> nn.Module:
    layers = max(1, round(num_params / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def formula(num_params: int, world: int, stage: int, nvme: bool = False) -> int:
    """fp32 Adam model states per rank: parameters 4, gradients 4, optimizer state 8 bytes each (on disk
    with NVMe optimizer offload)."""
    per_param = {0: 16, 1: 8 + 8 / world, 2: 4 + 12 / world, 3: 16 / world}[stage]
    if nvme:
        per_param -= 8 / world
    return int(per_param * num_params)


def _warm_up_runtime() -> None:
    """Touch the runtime once (oneDNN kernels and scratch, autograd threads, Gloo buffers) with a small model,
    so the baseline already holds what any model would add and the difference is the model's own states."""
    import torch.distributed as dist

    layer = nn.Linear(WIDTH, WIDTH)
    layer(torch.randn(2, WIDTH)).pow(2).mean().backward()
    dist.all_reduce(layer.weight.grad)
    dist.barrier()
    del layer


def _plain_torch(num_params: float) -> dict:
    """The same training in one plain torch process: what PyTorch itself adds beyond the 16Ψ of states
    (allocator slack, kernel scratch) — subtracted from every system's RSS growth."""
    torch.set_num_threads(1)
    layer = nn.Linear(WIDTH, WIDTH)
    layer(torch.randn(2, WIDTH)).pow(2).mean().backward()
    del layer
    _trim()
    before = _rss()
    torch.manual_seed(0)
    model = _mlp(num_params)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(3):
        model(torch.randn(2, WIDTH)).pow(2).mean().backward()
        optimizer.step()
    _trim()
    count = sum(p.numel() for p in model.parameters())
    return {"params": count, "overhead": _rss() - before - formula(count, 1, 0)}


def _config(stage: int, bucket: int | None, nvme_path: str | None = None) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if bucket:
        zero["reduce_bucket_size"] = bucket
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
    }


def _run(system: str, stage: int, num_params: float, bucket: int | None = None) -> dict:
    nvme_path = None
    if system == "shardspeed-nvme":
        import tempfile

        nvme_path = tempfile.mkdtemp(prefix="zero-memory-nvme-")

    if system == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed as engine_lib
    else:
        import shardspeed as engine_lib
    engine_lib.init_distributed(dist_backend="gloo")
    _warm_up_runtime()
    _trim()
    before = _rss()
    torch.manual_seed(0)
    model = _mlp(num_params)
    count = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    config = _config(stage, bucket, nvme_path)
    engine, *_ = engine_lib.initialize(model=model, optimizer=optimizer, config=config)
    del model, optimizer
    for _ in range(3):
        x = torch.randn(2, WIDTH)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    _trim()
    accounted = engine.memory_breakdown()["total"] if system != "deepspeed" else None
    delta = _rss() - before
    if nvme_path:
        engine.destroy()  # deletes the swap files
        os.rmdir(nvme_path)
    if system == "deepspeed":  # its shared-memory all-reduce leaves /dev/shm files behind
        import torch.distributed as dist

        from benchmarks.worker import remove_shared_memory_left_by

        dist.barrier()
        remove_shared_memory_left_by(os.environ["MASTER_PORT"])
    return {"params": count, "delta": delta, "accounted": accounted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--systems", nargs="+", default=["shardspeed"], choices=["shardspeed", "shardspeed-nvme", "deepspeed"]
    )
    parser.add_argument(
        "--reduce-bucket-size", type=int, default=None, help="elements (default: the system's)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_memory.md"))
    args = parser.parse_args()
    overhead = run_ranks(_plain_torch, 1, args.params, timeout=900)[0]["overhead"]
    rows = [
        "| system | stage | params | RSS growth/rank MiB | minus torch's own overhead | formula MiB | ratio "
        "| within 5% + 32 MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    raw = [{"system": "plain-torch", "overhead": overhead}]
    for system in args.systems:
        for stage in range(1 if system == "shardspeed-nvme" else 0, 4):
            runs = run_ranks(
                _run, args.world, system, stage, args.params, args.reduce_bucket_size, timeout=900
            )
            result = max(runs, key=lambda r: r["delta"])
            expected = formula(result["params"], args.world, stage, nvme=system == "shardspeed-nvme")
            states = result["delta"] - overhead
            ok = states <= 1.05 * expected + 32 * 2**20
            rows.append(
                f"| {system} | {stage} | {result['params'] / 1e6:.1f}M | {result['delta'] / 2**20:,.0f} | "
                f"{states / 2**20:,.0f} | {expected / 2**20:,.0f} | {states / expected:.2f}x | {'yes' if ok else 'no'} |"
            )
            raw.append({"system": system, "stage": stage, **result, "formula": expected})
            print(rows[-1], flush=True)
    header = (f"# ZeRO model-state memory per rank (RSS after malloc_trim), fp32 Adam, world {args.world}\n\n"
              "Measured by `python benchmarks/zero_memory.py`: RSS after three steps minus RSS after start-up, "
              "for the rank using more, minus what plain PyTorch adds beyond 16Ψ for the same training in one "
              f"process ({overhead / 2**20:.0f} MiB here: allocator slack and kernel scratch, not model "
              "states).\n\n")  # fmt: skip
    Path(args.out).write_text(header + "\n".join(rows) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
