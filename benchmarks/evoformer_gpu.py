"""benchmarks/evoformer.py --device cuda: the same measurements on one GPU, next to SDPA, in one process.

`run_device(args, "cpu")` runs the same code on the CPU (memory from the allocator's events instead of
CUDA's statistics), so tests/test_evoformer_benchmark.py checks this path without a GPU.

Systems (benchmarks/evoformer_cases.py): plain, sdpa (torch's scaled_dot_product_attention over all
sequences, mask + pair as one float mask that requires grad), ours (DS4Sci_EvoformerAttention, whose "auto"
backend runs SDPA block by block on CUDA), ours-math (its explicit kernel), and ours-1GiB (ours with a
1 GiB block target instead of the default max(256 MiB on CUDA, bytes of Q)). First a parity check: every
system's output and five gradients against an fp64 reference on the GPU, relative to the largest entry. Memory:
torch.cuda.max_memory_allocated over one forward + backward above what was allocated before it; a system
that runs out of memory is reported as OOM. Times: CUDA-synchronised, interleaved rounds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from pathlib import Path

import torch

from benchmarks import evoformer_cases as cases

SYSTEMS = ["plain", "sdpa", "ours", "ours-math", "ours-1GiB"]
GRID = [(32, 256), (256, 256), (128, 512), (64, 1024)]
QUICK_GRID = [(4, 64), (8, 96)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PARITY_DTYPES = {**DTYPES, "fp16": torch.float16}
BLOCK_N_RES = [128, 256, 384, 512, 768, 1024, 1536]
QUICK_BLOCK_N_RES = [32, 64]


@contextlib.contextmanager
def _chunk_target(mib: str | None):
    from shardspeed.ops.deepspeed4science.chunking import CHUNK_MB_ENV

    before = os.environ.get(CHUNK_MB_ENV)
    if mib is not None:
        os.environ[CHUNK_MB_ENV] = mib
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CHUNK_MB_ENV, None)
        else:
            os.environ[CHUNK_MB_ENV] = before


def attention(system: str):
    if system != "ours-1GiB":
        return cases.attention(system)
    ours = cases.attention("ours")

    def with_target(*tensors):
        with _chunk_target("1024"):
            return ours(*tensors)

    return with_target


def parity(dtype, device: str) -> dict:
    """Largest error of each system's output and gradients relative to the largest exact entry."""
    worst = {}
    for shape in [(4, 33, 4, 32), (3, 64, 2, 64)]:
        leaves, grad_out = cases.make_inputs(*shape, dtype, device)
        exact = [t.detach().double().requires_grad_() for t in leaves]
        reference = cases.attention("plain")(*exact)
        expected = [reference, *torch.autograd.grad(reference, exact, grad_out.double())]
        for system in SYSTEMS:
            out = attention(system)(*leaves)
            got = [out, *torch.autograd.grad(out, leaves, grad_out)]
            errors = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expected)]
            worst[system] = max(worst.get(system, 0.0), *errors)
    return worst


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_mib(fn, device: str) -> float | None:
    """Peak bytes allocated by fn() above those allocated before it, in MiB; None when out of memory."""
    if device != "cuda":
        return cases.tracked_peak_bytes(fn) / 2**20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        fn()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def device_case(n_seq: int, n_res: int, dtype, rounds: int, device: str) -> dict:
    """Peak memory of every system on one shape, then their times (interleaved) for those that fit."""
    case = {"n_seq": n_seq, "n_res": n_res, "heads": 4, "dim": 32, "rounds": rounds}
    itemsize = torch.empty((), dtype=dtype).element_size()
    row = {"n_seq": n_seq, "n_res": n_res, "logits_mib": cases.logits_mib(n_seq, n_res, 4, itemsize)}
    leaves, grad_out = cases.make_inputs(n_seq, n_res, 4, 32, dtype, device)
    row["peak_mib"] = {}
    for system in SYSTEMS:
        fn = attention(system)
        row["peak_mib"][system] = peak_mib(lambda fn=fn: cases.step(fn, leaves, grad_out), device)
    leaves = grad_out = None  # freed before the timing rounds allocate their own inputs
    runnable = [system for system, peak in row["peak_mib"].items() if peak is not None]
    row["seconds"] = cases.time_systems(case, runnable, device, dtype, lambda: _sync(device), attention)
    return row


def _example_module():
    path = Path(__file__).resolve().parents[1] / "examples/evoformer/model.py"
    spec = importlib.util.spec_from_file_location("evoformer_example_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def block_search(attention_name: str, n_res_list, budget_mib: float, block: dict, device: str) -> dict:
    """Climb n_res until one training step of one example block peaks over the budget (or runs out)."""
    module = _example_module()
    torch.manual_seed(0)
    model = module.Evoformer(blocks=1, attention=attention_name, **block["model"]).to(device)
    steps = []
    for n_res in n_res_list:
        sample = module.SyntheticMSA(size=1, n_seq=block["n_seq"], n_res=n_res)[0]
        batch = {key: value.unsqueeze(0).to(device) for key, value in sample.items()}

        def train_step(batch=batch):
            model.zero_grad(set_to_none=True)
            model(batch).backward()

        model.zero_grad(set_to_none=True)
        peak = peak_mib(train_step, device)
        start = time.perf_counter()
        if peak is not None:
            train_step()
            _sync(device)
        steps.append({"n_res": n_res, "peak_mib": peak if peak is not None else float("inf"),
                      "seconds": time.perf_counter() - start})  # fmt: skip
        model.zero_grad(set_to_none=True)
        if peak is None or peak > budget_mib:
            break
    fits = [s for s in steps if s["peak_mib"] <= budget_mib]
    return {"attention": attention_name, "largest": fits[-1] if fits else None, "steps": steps}


def render(result: dict) -> list[str]:
    from benchmarks.evoformer import render_block

    lines = [f"Evoformer attention on {result['machine']}: forward + backward, Q/K/V [1, n_seq, n_res, 4, 32], "
             "mask + pair bias. Memory: peak allocated above the inputs (MiB); time: median ms of "
             f"{result['rounds']} interleaved rounds.", "",
             "Parity (largest error relative to the largest exact entry, output and 5 gradients): " +
             "; ".join(f"{d}: " + ", ".join(f"{s} {e:.1e}" for s, e in errs.items())
                       for d, errs in result["parity"].items()), ""]  # fmt: skip
    header = " | ".join(f"{s} MiB | {s} ms" for s in SYSTEMS)
    for dtype_name, rows in result["grid"].items():
        lines += [f"{dtype_name}:", "", f"| n_seq | n_res | whole logits (MiB) | {header} |",
                  "|---|---|---|" + "---|---|" * len(SYSTEMS)]  # fmt: skip
        for row in rows:
            cells = []
            for system in SYSTEMS:
                peak, times = row["peak_mib"][system], row["seconds"].get(system)
                cells.append("OOM | -" if peak is None else f"{peak:.0f} | {cases.median(times) * 1e3:.1f}")
            lines.append(
                f"| {row['n_seq']} | {row['n_res']} | {row['logits_mib']:.0f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return lines + render_block(result, "allocated")


def run_device(args, device: str = "cuda") -> tuple[dict, list[str]]:
    from benchmarks.evoformer import BLOCK, _machine

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in every system
    result = {"device": device, "machine": _machine(device), "rounds": args.rounds}
    result["parity"] = {
        name: parity(dtype, device) for name, dtype in {**DTYPES, "fp16": torch.float16}.items()
    }
    grid = QUICK_GRID if args.quick else GRID
    result["grid"] = {
        name: [device_case(n_seq, n_res, dtype, args.rounds, device) for n_seq, n_res in grid]
        for name, dtype in DTYPES.items()
    }
    n_res_list = QUICK_BLOCK_N_RES if args.quick else BLOCK_N_RES
    runs = [block_search(a, n_res_list, args.budget_mib, BLOCK, device) for a in ("plain", "evoformer")]
    result["block"] = {"budget_mib": args.budget_mib, "runs": runs}
    return result, render(result)
