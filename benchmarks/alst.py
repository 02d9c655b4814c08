"""ALST: the longest sequence a small Llama trains at under a per-rank memory cap, with and without Ulysses
sp 2 + tiling, and the step time each costs.

    PYTHONPATH=. python benchmarks/alst.py --cap-gib 2.0 --max-len 65536 --timeout 420 --timing-length 4096

A Hugging Face LlamaForCausalLM built from a config (no download; vocab 32000, hidden 128, 2 layers, 4 heads
over 2 key/value heads, intermediate 512, fp32, attn_implementation="sdpa") trains through
`shardspeed.initialize` (ZeRO 0, AdamW) in three configurations:

- `baseline`: 1 process, whole sequences, the model's own loss (the logits exist whole, upcast to fp32);
- `sp2`: 2 processes, Ulysses (`UlyssesSPAttentionHF.register_with_transformers`, the sequence-parallel
  groups as the engine's mpu, batches through `UlyssesSPDataLoaderAdapter`), untiled loss over the local slice;
- `alst`: `sp2` plus `TiledMLP` patched into LlamaMLP (ceil(s / hidden) tiles, DeepSpeed's recipe) and
  `TiledFusedLogitsLoss` over tiles of 1024 tokens, so the logits never exist whole.

"Fits" means every rank's peak resident memory (`ru_maxrss`: the whole process, runtime and model state
included) stays within `--cap-gib` during two training steps; the cap stands in for device memory. Lengths
double from `--min-len` to `--max-len` (the search bound); a configuration stops at the first length that
exceeds the cap or `--timeout` seconds, so no run grows past about twice the cap. Each length runs in fresh
processes (Gloo on loopback, 1 thread each); the second step is timed.

The step-time cost of tiling is measured apart (`--timing-length`): sp2 and alst models built in the same
two processes, their steps alternating, so both see the same machine load; `--reuse-search` reruns only
this on the search results already in --out. Results go to benchmarks/results/alst.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 32000, 128, 2, 4, 2, 512
LOSS_TILE = 1024  # tokens per TiledFusedLogitsLoss tile
CONFIGS = {"baseline": (1, False), "sp2": (2, False), "alst": (2, True)}  # name: (sequence degree, tiling)


def _rss_gib() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return kib / 2**20


def _tile_mlps(model) -> None:
    """DeepSpeed's documented recipe, per module: LlamaMLP.forward through TiledMLP with ceil(seqlen / hidden)
    tiles (DeepSpeed patches the class; patching the instances lets a tiled and an untiled model share a
    process)."""
    from transformers.models.llama import modeling_llama

    from shardspeed.sequence import TiledMLP

    def tiled_forward(self, x):
        shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
        return TiledMLP.apply(modeling_llama.LlamaMLP.forward, self, x, shards, list(self.parameters()))

    for module in model.modules():
        if isinstance(module, modeling_llama.LlamaMLP):
            module.forward = types.MethodType(tiled_forward, module)


def _build(sp: int, tiled: bool, mpu=None):
    """An engine for a fresh model (same seed every time); Ulysses is registered unless `mpu` is given."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardspeed

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=1 << 17)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if tiled:
        _tile_mlps(model)
    if sp > 1 and mpu is None:
        from shardspeed.sequence import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, micro_batch_size=1)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}  # fmt: skip
    engine, *_ = shardspeed.initialize(model=model, config=ds_config, mpu=mpu)
    return engine, mpu


def _sp_loss(engine, batch, group, tiled: bool):
    """The Trainer's ALST loss: token-loss sums and counts gathered over the sequence group."""
    import torch.distributed.nn.functional as dist_nn
    from torch.nn import functional as F

    from shardspeed.sequence import TiledFusedLogitsLoss

    model = engine.module
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
    labels = batch["shift_labels"]

    def loss_sum(head, x, y):
        return F.cross_entropy(head(x).float().reshape(-1, VOCAB), y.reshape(-1), reduction="sum")

    if tiled:
        shards = max(1, math.ceil(labels.numel() / LOSS_TILE))
        total = TiledFusedLogitsLoss.apply(loss_sum, model.lm_head, hidden, labels, None, shards,
                                           [model.lm_head.weight], "sum")  # fmt: skip
    else:
        total = loss_sum(model.lm_head, hidden, labels)
    tokens = (labels != -100).sum().float()
    sums, counts = dist_nn.all_gather(total, group=group), dist_nn.all_gather(tokens, group=group)
    return torch.stack(sums).sum() / torch.stack(counts).sum()


def _step(engine, mpu, batch: dict, sp: int, tiled: bool) -> tuple[float, torch.Tensor]:
    """One training step on `batch` (the whole sequence; sharded through the adapter when sp > 1): (s, loss)."""
    start = time.perf_counter()
    if sp > 1:
        from shardspeed.sequence import UlyssesSPDataLoaderAdapter

        group = mpu.get_sequence_parallel_group()
        adapter = UlyssesSPDataLoaderAdapter(
            [dict(batch)], mpu.get_sequence_parallel_rank(), group, sp, "cpu"
        )
        loss = _sp_loss(engine, next(adapter), group, tiled)
    else:
        loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start, loss


def _timing_worker(rank: int, port: int, length: int, steps: int, out: str) -> None:
    """sp 2 with and without tiling in the same two processes, steps alternating, so both see the same load."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), SHARDSPEED_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plain, mpu = _build(2, False)
    tiled, _ = _build(2, True, mpu)
    tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens, "position_ids": torch.arange(length).unsqueeze(0), "labels": tokens}
    times = {"sp2": [], "alst": []}
    for step in range(steps + 1):  # the first step of each is warm-up
        for name, engine, is_tiled in (("sp2", plain, False), ("alst", tiled, True)):
            seconds, _ = _step(engine, mpu, batch, 2, is_tiled)
            if step:
                times[name].append(seconds)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def timing(length: int, steps: int, out: Path) -> dict:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_timing_worker, args=(r, port, length, steps, str(out))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    times = json.loads(out.read_text())
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"length": length, "steps": steps, "median_step_s": medians, "alst_over_sp2": medians["alst"] / medians["sp2"],
            "step_s": times}  # fmt: skip


def _worker(rank: int, world: int, port: int, name: str, length: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), SHARDSPEED_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    result = {"rank": rank}
    try:
        dist.init_process_group("gloo")
        sp, tiled = CONFIGS[name]
        engine, mpu = _build(sp, tiled)
        result["rss_after_init_gib"] = _rss_gib()
        tokens = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": tokens, "position_ids": torch.arange(length).unsqueeze(0), "labels": tokens}
        times = [_step(engine, mpu, batch, sp, tiled) for _ in range(2)]
        loss = times[-1][1]
        times = [t for t, _ in times]
        result.update(step_s=times[-1], loss=loss.item(),
                      peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # fmt: skip
    except Exception:
        result["error"] = traceback.format_exc(limit=4)
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(result, handle)
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_one(name: str, length: int, timeout: float, scratch: Path) -> dict:
    world = CONFIGS[name][0]
    out = scratch / f"{name}-{length}.json"
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, name, length, str(out))) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    if any(proc.is_alive() for proc in procs):
        for proc in procs:  # only the processes this function started
            proc.kill()
            proc.join()
        return {"config": name, "length": length, "status": f"over the {timeout:.0f} s time bound"}
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"config": name, "length": length, "status": "error", "error": errors[0]}
    return {
        "config": name, "length": length, "status": "ran",
        "peak_rss_gib": max(r["peak_rss_gib"] for r in ranks),
        "rss_after_init_gib": max(r["rss_after_init_gib"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks), "loss": ranks[0]["loss"],
    }  # fmt: skip


def search(name: str, args, scratch: Path) -> list[dict]:
    rows, length = [], args.min_len
    while length <= args.max_len:
        row = run_one(name, length, args.timeout, scratch)
        row["fits"] = row["status"] == "ran" and row["peak_rss_gib"] <= args.cap_gib
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        if not row["fits"]:
            break
        length *= 2
    return rows


def report(rows: list[dict], args, timed: dict | None) -> str:
    lines = [
        "# ALST: longest trainable sequence under a per-rank memory cap, Ulysses sp 2 + tiling against without",
        "",
        f"Model: Llama from a config (vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads over "
        f"{KV_HEADS} key/value heads, intermediate {INTERMEDIATE}), fp32, sdpa, ZeRO 0, AdamW, micro-batch 1. "
        f"CPU, Gloo, 1 thread per rank, on a shared 2-core machine (timings are noisy; memory is not). "
        f"Cap: {args.cap_gib} GiB peak resident memory per rank (whole process); search: lengths doubling "
        f"from {args.min_len} to {args.max_len}, {args.timeout:.0f} s per run.",
        "",
        "| config | ranks | sequence | peak RSS/rank (GiB) | RSS after init (GiB) | step s | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ran":
            lines.append(f"| {r['config']} | {CONFIGS[r['config']][0]} | {r['length']} | - | - | - | "
                         f"no ({r['status']}) |")  # fmt: skip
            continue
        lines.append(f"| {r['config']} | {CONFIGS[r['config']][0]} | {r['length']} | {r['peak_rss_gib']:.2f} | "
                     f"{r['rss_after_init_gib']:.2f} | {r['step_s']:.2f} | {'yes' if r['fits'] else 'no'} |")  # fmt: skip
    lines.append("")
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        fitting = [r["length"] for r in mine if r["fits"]]
        stop = next((r for r in mine if not r["fits"]), None)
        if stop is None:
            why = f"the search bound {args.max_len}"
        elif stop["status"] == "ran":
            why = f"{stop['length']} peaked at {stop['peak_rss_gib']:.2f} GiB, over the cap"
        else:
            why = f"{stop['length']}: {stop['status']}"
        lines.append(f"- longest sequence within the cap, {name}: {max(fitting) if fitting else None} "
                     f"(stopped by {why})")  # fmt: skip
    if timed:
        m = timed["median_step_s"]
        lines.append(f"- step time at {timed['length']} tokens, sp 2 with and without tiling in the same two "
                     f"processes, steps alternating ({timed['steps']} timed each, median): sp2 {m['sp2']:.2f} s, "
                     f"alst {m['alst']:.2f} s; alst / sp2 = {timed['alst_over_sp2']:.2f} (the tiles' recompute: "
                     "one more MLP and LM-head forward)")  # fmt: skip
    lines.append(
        "- the step times in the table come from separate runs minutes apart on a machine whose load "
        "varied (load average 15-30 on 2 cores): compare memory there, time only in the line above"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=2.0)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--timeout", type=float, default=420.0)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--timing-length", type=int, default=4096, help="0: no interleaved timing run")
    parser.add_argument("--timing-steps", type=int, default=3)
    parser.add_argument("--reuse-search", action="store_true", help="keep the search rows of --out's JSON")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "alst"))
    args = parser.parse_args()
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"alst-bench-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    previous = json.loads(Path(f"{args.out}.json").read_text()) if args.reuse_search else {}
    if args.reuse_search:
        rows = previous["rows"]
        for key in ("cap_gib", "min_len", "max_len", "timeout"):  # the search's own conditions
            setattr(args, key, previous["args"][key])
    else:
        rows = [row for name in args.configs for row in search(name, args, scratch)]
    if args.timing_length:
        timed = timing(args.timing_length, args.timing_steps, scratch / "timing.json")
    else:  # --timing-length 0: keep the timing already recorded, if any
        timed = previous.get("timing")
    Path(f"{args.out}.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "timing": timed}, indent=1)
    )
    Path(f"{args.out}.md").write_text(report(rows, args, timed))
    print(report(rows, args, timed))


if __name__ == "__main__":
    main()
