"""Tensor parallelism on 4 CPU ranks: tokens/s and bytes communicated per step, shardspeed vs DeepSpeed.

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/benchvenv/bin/python benchmarks/tensor_parallel.py --rounds 3

For each round, in interleaved order: shardspeed tp1 x dp4, shardspeed tp2 x dp2, DeepSpeed 0.19.8 AutoTP
training tp1 x dp4 and tp2 x dp2 — the same Hugging Face LLaMA (random weights, built from a config), batches,
AdamW, global-norm clipping at 1.0 and ZeRO stage 1. Each run is a fresh 4-process Gloo job (loopback). Bytes per step count what every
rank hands to torch.distributed's collectives (all_reduce, reduce, reduce_scatter, all_gather, broadcast):
per call the largest tensor (or tensor list) it is given, i.e. the full buffer of a reduce-scatter or
all-gather, summed over calls and ranks during the timed steps. On Gloo shardspeed issues a reduce-scatter as
one `reduce` per slice and an all-gather as one `broadcast` per slice, so the same bytes are counted. A system that fails records its error instead of numbers.
Results: benchmarks/results/tensor_parallel.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORLD, MICRO, SEQ, WARMUP = 4, 4, 128, 2
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_attention_heads=8,
             num_key_value_heads=4, num_hidden_layers=4, max_position_embeddings=SEQ)  # fmt: skip
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
               "reduce_scatter", "_all_gather_base", "_reduce_scatter_base")  # fmt: skip


def _count_bytes(counter: dict) -> None:
    """Wrap torch.distributed's collectives to add up the bytes of the tensors handed to them."""
    import torch
    import torch.distributed as dist

    def nbytes(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, (list, tuple)):
            return sum(nbytes(o) for o in obj)
        return 0

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, **kwargs):
            if counter["on"]:  # the collective's full buffer: the largest tensor (list) handed to it
                counter["bytes"] += max([nbytes(a) for a in args] + [nbytes(v) for v in kwargs.values()])
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def _rank_main(rank: int, impl: str, tp: int, steps: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_SIZE=str(WORLD))  # fmt: skip
    import torch
    import transformers

    torch.set_num_threads(1)
    counter = {"on": False, "bytes": 0}
    _count_bytes(counter)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,  # explicit: the two systems' defaults differ
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": tp},
        "steps_per_print": 10_000,
    }
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    if impl == "deepspeed":
        import deepspeed as ds
    else:
        import shardspeed as ds
    ds.init_distributed(dist_backend="gloo")
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config,
                               optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4))  # fmt: skip
    dp = WORLD // tp
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, MODEL["vocab_size"], (steps + WARMUP, MICRO * dp, SEQ), generator=g)
    dp_rank = (rank // tp) if tp > 1 else rank
    times, losses = [], []
    for step in range(steps + WARMUP):
        ids = data[step, dp_rank * MICRO : (dp_rank + 1) * MICRO]
        counter["on"] = step >= WARMUP
        started = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
    counter["on"] = False
    queue.put((rank, times, counter["bytes"], losses))


def run_job(impl: str, tp: int, steps: int) -> dict:
    """One 4-rank job; returns step time median, tokens/s and bytes per step (summed over ranks)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, impl, tp, steps, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in range(WORLD):
            results.append(queue.get(timeout=900))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        from benchmarks.worker import remove_shared_memory_left_by  # DeepSpeed's /dev/shm files

        remove_shared_memory_left_by(port)
    # a step ends with its slowest rank; the loss is the mean over ranks (tensor ranks repeat their replica's)
    per_step = [max(r[1][i] for r in results) for i in range(steps)]
    median = statistics.median(per_step)
    tokens = MICRO * SEQ * (WORLD // tp)
    return dict(step_s=median, step_min=min(per_step), step_max=max(per_step), tokens_per_s=tokens / median,
                bytes_per_step=sum(r[2] for r in results) / steps,
                loss=statistics.mean(statistics.mean(r[3]) for r in results))  # fmt: skip


def worker(args) -> None:
    try:
        out = run_job(args.impl, args.tp, args.steps)
    except Exception as err:  # recorded, not hidden: the table shows it
        out = {"error": f"{type(err).__name__}: {err}"[:2000]}
    print("RESULT " + json.dumps(out))


def driver(args) -> None:
    systems = [("shardspeed", 1), ("shardspeed", 2), ("deepspeed", 1), ("deepspeed", 2)]
    runs: dict[str, list] = {f"{i} tp{t}": [] for i, t in systems}
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for _ in range(args.rounds):
        for impl, tp in systems:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--impl",
                impl,
                "--tp",
                str(tp),
                "--steps",
                str(args.steps),
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            result = json.loads(line[7:]) if line else {"error": (proc.stderr or proc.stdout)[-2000:]}
            runs[f"{impl} tp{tp}"].append(result)
            print(impl, tp, result, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor_parallel.json").write_text(json.dumps({"model": MODEL, "micro": MICRO, "seq": SEQ,
                                                          "world": WORLD, "runs": runs}, indent=1))  # fmt: skip
    (out / "tensor_parallel.md").write_text(report(runs, args))


def report(runs: dict, args) -> str:
    lines = [
        "# Tensor parallelism on 4 CPU ranks (`benchmarks/tensor_parallel.py`)",
        "",
        f"LLaMA from a config ({MODEL['num_hidden_layers']} layers, width {MODEL['hidden_size']}, "
        f"{MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} kv heads, vocabulary "
        f"{MODEL['vocab_size']}), sequence {SEQ}, micro-batch {MICRO} per replica, AdamW, ZeRO-1, Gloo on "
        f"loopback, one thread per rank. {args.rounds} interleaved rounds x {args.steps} timed steps. Shared "
        "2-core machine: 4 ranks oversubscribe it, timings are noisy; medians over rounds, min/max of steps.",
        "",
        "| system | tokens/s (median) | step s (median, min-max) | bytes communicated / step (all ranks) | "
        "ratio to shardspeed tp1 | mean loss |",
        "|---|---|---|---|---|---|",
    ]
    base = _median(runs.get("shardspeed tp1", []), "tokens_per_s")
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            lines.append(f"| {name} | failed: {results[0]['error'].splitlines()[-1] if results else 'not run'} "
                         "| | | | |")  # fmt: skip
            continue
        tps = _median(ok, "tokens_per_s")
        lines.append(
            f"| {name} | {tps:,.0f} | {_median(ok, 'step_s'):.3f} ({min(r['step_min'] for r in ok):.3f}-"
            f"{max(r['step_max'] for r in ok):.3f}) | {_median(ok, 'bytes_per_step') / 1e6:,.2f} MB | "
            f"{tps / base if base else float('nan'):.2f} | {_median(ok, 'loss'):.4f} |"
        )
    errors = {n: r[0]["error"] for n, r in runs.items() if r and "error" in r[0]}
    for name, err in errors.items():
        lines += ["", f"{name} error (last lines):", "", "```", *err.strip().splitlines()[-12:], "```"]
    return "\n".join(lines) + "\n"


def _median(results: list, key: str) -> float:
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--impl", choices=["shardspeed", "deepspeed"])
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
