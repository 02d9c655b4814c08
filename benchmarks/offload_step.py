"""ZeRO-Offload's optimizer step against the bare fused kernel on the same number of elements.

    python benchmarks/offload_step.py --params 50e6 --rounds 5 --steps 5 --dtype bf16 --dtype fp32

With `offload_optimizer: cpu` the step runs on the host. Its floor is torch's fused AdamW kernel over one
flat fp32 tensor of the model's size (the kernel DeepSpeedCPUAdam maps to); everything the engine adds —
the gradient norm for clipping, unscaling, dtype conversion, copying updated masters into the 16-bit
shards, Python — is overhead. On a CPU-only machine there are no device copies, so this measures exactly
that overhead (target: at most 1.15x the bare kernel). One process (world 1, so no collective), an MLP of
`--params` parameters, stage 2; the two are timed in alternating rounds so machine noise hits both.
Writes benchmarks/results/offload_step.md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 2048


def _config(dtype: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _engine(num_params: float, dtype: str):
    import shardspeed

    layers = max(1, round(num_params / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    engine, *_ = shardspeed.initialize(model=model, config=_config(dtype))
    return engine


def _time_engine_steps(engine, steps: int) -> list[float]:
    x = torch.randn(8, WIDTH, dtype=next(engine.module.parameters()).dtype)
    times = []
    for _ in range(steps):
        engine.backward(engine(x).float().pow(2).mean())
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _time_bare_kernel(numel: int, steps: int, module_dtype: torch.dtype | None = None) -> list[float]:
    """The fused kernel alone; with `module_dtype`, also the one copy of the updated fp32 values into the
    16-bit module weights that mixed precision cannot avoid (the floor for a bf16 step)."""
    flat = torch.zeros(numel, requires_grad=True)
    flat.grad = torch.randn(numel) * 1e-3
    weights = torch.empty(numel, dtype=module_dtype) if module_dtype is not None else None
    optimizer = torch.optim.AdamW([flat], lr=1e-4, weight_decay=0.01, fused=True)
    optimizer.step()  # state created outside the timing, as the engine's is after its first step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        if weights is not None:
            weights.copy_(flat.detach())
        times.append(time.perf_counter() - start)
    return times


def measure(num_params: float, dtype: str, rounds: int, steps: int) -> dict:
    engine = _engine(num_params, dtype)
    numel = sum(p.numel() for p in engine.module.parameters())
    _time_engine_steps(engine, 2)  # warm-up: optimizer state, allocator
    module_dtype = torch.bfloat16 if dtype == "bf16" else None
    engine_rounds, kernel_rounds, floor_rounds = [], [], []
    for _ in range(rounds):
        engine_rounds.append(statistics.median(_time_engine_steps(engine, steps)))
        kernel_rounds.append(statistics.median(_time_bare_kernel(numel, steps)))
        if module_dtype is not None:
            floor_rounds.append(statistics.median(_time_bare_kernel(numel, steps, module_dtype)))
    engine.destroy()
    ratios = [e / k for e, k in zip(engine_rounds, kernel_rounds)]
    floor_ratios = [e / f for e, f in zip(engine_rounds, floor_rounds or kernel_rounds)]
    return {
        "dtype": dtype,
        "params": numel,
        "threads": torch.get_num_threads(),
        "engine_step_s": engine_rounds,
        "bare_kernel_s": kernel_rounds,
        "kernel_plus_weight_copy_s": floor_rounds or kernel_rounds,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "floor_ratio_median": statistics.median(floor_ratios),
    }


def _table(results: list[dict]) -> str:
    lines = [
        "| dtype | parameters | threads | engine step (median of rounds) | bare fused AdamW | ratio median (min-max) "
        "| kernel + copy into 16-bit weights | ratio to that |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['dtype']} | {r['params'] / 1e6:.1f}M | {r['threads']} | "
            f"{statistics.median(r['engine_step_s']) * 1e3:.1f} ms | "
            f"{statistics.median(r['bare_kernel_s']) * 1e3:.1f} ms | "
            f"{r['ratio_median']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
            f"{statistics.median(r['kernel_plus_weight_copy_s']) * 1e3:.1f} ms | {r['floor_ratio_median']:.3f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", action="append", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "offload_step"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(args.threads)
    results = [measure(args.params, d, args.rounds, args.steps) for d in args.dtype or ["bf16", "fp32"]]
    table = _table(results)
    print(table)
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1))
    Path(f"{args.out}.md").write_text(
        "# ZeRO-Offload step vs the bare fused AdamW kernel (benchmarks/offload_step.py)\n\n" + table + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
