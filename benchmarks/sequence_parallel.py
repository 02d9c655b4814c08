"""Ulysses sequence parallelism: tokens/s and bytes communicated per step at sp 1 and sp 2 on 4 ranks, and the
activation bytes saved per rank; shardspeed beside DeepSpeed 0.19.8's `deepspeed.sequence.layer`.

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/benchvenv/bin/python benchmarks/sequence_parallel.py --steps 6

Four ranks (spawned processes, Gloo on loopback) train the same GPT (same seeds, same batches) with
`shardspeed.initialize` + `shardspeed.sequence.DistributedAttention` and, when DeepSpeed is importable, with
`deepspeed.initialize(mesh_param=(dp, sp))` + `deepspeed.sequence.layer.DistributedAttention`, one step of each
in turn (interleaved, so both see the same machine load). sp 1 is plain data parallelism over 4 ranks; sp 2 is
2 sequence ranks x 2 data ranks. Bytes communicated: the sizes of the tensors handed to every
`torch.distributed` collective during one step on rank 0 (a counting wrapper around the functions both
libraries call). Activation bytes: the distinct tensors autograd saves in one forward on rank 0, parameters
excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB, DIM, HEADS, LAYERS, SEQ, MICRO = 256, 128, 8, 4, 512, 1
COUNTED = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
           "reduce", "all_gather", "reduce_scatter")  # fmt: skip


class Meter:
    """Wraps torch.distributed's collectives to count the bytes of their input tensors."""

    def __init__(self):
        self.bytes = 0
        for name in COUNTED:
            setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            for t in list(args[:2]) + list(kwargs.values()):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
                    break
                if isinstance(t, list) and t and isinstance(t[0], torch.Tensor):
                    self.bytes += sum(x.numel() * x.element_size() for x in t)
                    break
            return fn(*args, **kwargs)

        return counted


class LocalAttention(nn.Module):
    def forward(self, q, k, v):  # [b, s, h, d], causal over s
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, attn_factory):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.attn, self.distributed = attn_factory(LocalAttention())

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        context = self.attn(q, k, v, 0) if self.distributed else self.attn(q, k, v)
        x = x + self.out(context.reshape(b, s, DIM))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, attn_factory):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(attn_factory) for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, pos, labels):
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x)).reshape(-1, VOCAB), labels.reshape(-1))


def config(sp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 0},
            "sequence_parallel_size": sp}  # fmt: skip


def build(system: str, sp: int):
    """(engine, sequence group) for `system` at sequence degree `sp`."""
    torch.manual_seed(0)
    if system == "shardspeed":
        import shardspeed
        from shardspeed.sequence import DistributedAttention

        holder = {}
        model = GPT(
            lambda local: (_Late(local, holder, DistributedAttention), sp > 1) if sp > 1 else (local, False)
        )
        engine, *_ = shardspeed.initialize(model=model, optimizer=_adamw(model), config=config(sp))
        holder["group"] = engine.get_sequence_parallel_group()
        return engine, holder.get("group")
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups

    holder = {}
    model = GPT(
        lambda local: (_Late(local, holder, DistributedAttention), sp > 1) if sp > 1 else (local, False)
    )
    cfg = {k: v for k, v in config(sp).items() if k != "sequence_parallel_size"}
    mesh = (dist.get_world_size() // sp, sp) if sp > 1 else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model), config=cfg, mesh_param=mesh)
    holder["group"] = groups._get_sequence_parallel_group() if sp > 1 else None
    return engine, holder.get("group")


def _adamw(model):
    """torch's AdamW for both libraries (DeepSpeed's own would JIT-compile a C++ op on CPU)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


class _Late(nn.Module):
    """DistributedAttention built on first use: the sequence group exists only after initialize."""

    def __init__(self, local, holder, cls):
        super().__init__()
        self.local, self.holder, self.cls, self.inner = local, holder, cls, None

    def forward(self, q, k, v, batch_dim_idx):
        if self.inner is None:
            self.inner = self.cls(self.local, self.holder["group"], scatter_idx=2, gather_idx=1)
        return self.inner(q, k, v, batch_dim_idx)


def batch(step: int, sp: int, group):
    dp_world = dist.get_world_size() // sp
    dp_rank = dist.get_rank() // sp  # sequence groups are consecutive ranks in both libraries
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (dp_world * MICRO, SEQ + 1), generator=g)[dp_rank * MICRO :][:MICRO]
    full = (tokens[:, :-1], torch.arange(SEQ).expand(MICRO, SEQ), tokens[:, 1:])
    if sp == 1:
        return full
    rank = dist.get_rank(group)
    return tuple(t.chunk(sp, dim=1)[rank] for t in full)


def saved_bytes(engine, inputs) -> int:
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(*inputs)
    engine.backward(loss)
    engine.step()
    return sum(seen.values())


def worker(rank: int, world: int, port: int, steps: int, systems: list[str], out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    if os.environ.get("SP_BENCH_TRACE"):  # where a rank waits, if the run hangs
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["SP_BENCH_TRACE"]), exit=True)
    meter = Meter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for sp in (1, 2):
        engines = {}
        for system in systems:
            try:
                engines[system] = build(system, sp)
            except Exception:
                results.append({"system": system, "sp": sp, "error": traceback.format_exc(limit=3)})
        if not engines:
            continue
        times = {s: [] for s in engines}
        comm = {s: [] for s in engines}
        act = {s: saved_bytes(e, batch(0, sp, g)) for s, (e, g) in engines.items()}  # also the warm-up step
        for step in range(1, steps + 1):
            for system, (engine, group) in engines.items():  # interleaved: one step of each in turn
                inputs = batch(step, sp, group)
                dist.barrier()
                before, start = meter.bytes, time.perf_counter()
                loss = engine(*inputs)
                engine.backward(loss)
                engine.step()
                dist.barrier()
                times[system].append(time.perf_counter() - start)
                comm[system].append(meter.bytes - before)
        for system in engines:
            tokens = MICRO * SEQ * (world // sp)  # global tokens per step
            ts = times[system]
            results.append({"system": system, "sp": sp, "median_s": statistics.median(ts), "min_s": min(ts),
                            "max_s": max(ts), "tokens_per_s": tokens / statistics.median(ts),
                            "bytes_per_step_rank0": statistics.median(comm[system]),
                            "activation_bytes_rank0": act[system]})  # fmt: skip
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(results: list[dict], steps: int) -> str:
    lines = [f"# Ulysses sequence parallelism, 4 CPU ranks (Gloo), {steps} timed steps each, interleaved",
             "", f"GPT: {LAYERS} layers, dim {DIM}, {HEADS} heads, sequence {SEQ}, micro-batch {MICRO}, ZeRO 0, "
             "fp32. Timings on a shared, noisy 2-core machine: read ratios, not absolute figures.", "",
             "| system | sp | tokens/s | median s/step (min-max) | bytes communicated/step (rank 0) | "
             "activation bytes saved (rank 0) |", "|---|---|---|---|---|---|"]  # fmt: skip
    errors = []
    for r in results:
        if "error" in r:
            errors.append(f"- {r['system']} sp {r['sp']}: `{r['error'].strip().splitlines()[-1]}`")
            continue
        lines.append(f"| {r['system']} | {r['sp']} | {r['tokens_per_s']:.0f} | {r['median_s']:.3f} "
                     f"({r['min_s']:.3f}-{r['max_s']:.3f}) | {r['bytes_per_step_rank0'] / 2**20:.2f} MiB | "
                     f"{r['activation_bytes_rank0'] / 2**20:.2f} MiB |")  # fmt: skip
    by = {(r["system"], r["sp"]): r for r in results if "error" not in r}
    lines.append("")
    for sp in (1, 2):
        if ("shardspeed", sp) in by and ("deepspeed", sp) in by:
            ratio = by[("shardspeed", sp)]["tokens_per_s"] / by[("deepspeed", sp)]["tokens_per_s"]
            lines.append(f"- sp {sp}: shardspeed/DeepSpeed tokens/s = {ratio:.2f}")
    if ("shardspeed", 1) in by and ("shardspeed", 2) in by:
        ratio = (
            by[("shardspeed", 2)]["activation_bytes_rank0"] / by[("shardspeed", 1)]["activation_bytes_rank0"]
        )
        lines.append(f"- shardspeed activation bytes per rank, sp 2 / sp 1: {ratio:.3f}")
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--systems", nargs="+", default=["shardspeed", "deepspeed"])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "sequence_parallel.json"
    port = free_port()
    mp.spawn(worker, args=(4, port, args.steps, args.systems, str(raw)), nprocs=4)
    from benchmarks.worker import remove_shared_memory_left_by  # DeepSpeed's /dev/shm files

    remove_shared_memory_left_by(port)
    results = json.loads(raw.read_text())
    (out / "sequence_parallel.md").write_text(report(results, args.steps))
    print((out / "sequence_parallel.md").read_text())


if __name__ == "__main__":
    main()
