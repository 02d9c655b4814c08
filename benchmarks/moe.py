"""Mixture of Experts: tokens/s and all-to-all bytes per step of a MoE GPT, shardspeed against DeepSpeed-MoE.

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/benchvenv/bin/python benchmarks/moe.py --rounds 3 --steps 8 \
        --warmup 2 --out benchmarks/results

A GPT (token + position embedding, 2 blocks of attention + an MoE feed-forward of 8 experts with top-2
gating, head; width 128, seq 64, micro-batch 4 per rank) trains on 2 ranks (Gloo, one thread per rank) with
the same seeds, data and AdamW, in these systems, each a separate 2-rank job, interleaved round by round:

- `shardspeed ep{1,2} z{2,3}`: `import shardspeed as deepspeed` and `deepspeed.moe.layer.MoE(ep_size=...)`;
- `deepspeed ep{1,2} z2`: DeepSpeed 0.19.8 (CPU accelerator) and its own `MoE` — DeepSpeed refuses MoE
  under ZeRO-3, so it runs at stage 2 only.

Reported per system: median tokens/s over the rounds (each round's value the median step time over the
measured steps), min/max over the rounds, and the bytes of all-to-all this rank sends per step (counted
the same way for both systems, by wrapping `torch.distributed.all_to_all_single`: the input's size times
(world - 1) / world, forward and backward). A job that fails records its error.
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

VOCAB, DIM, HEADS, LAYERS, SEQ, MICRO, EXPERTS, K = 512, 128, 4, 2, 64, 4, 8, 2
SYSTEMS = [("shardspeed", 1, 2), ("shardspeed", 2, 2), ("shardspeed", 1, 3), ("shardspeed", 2, 3),
           ("deepspeed", 1, 2), ("deepspeed", 2, 2)]  # fmt: skip


def build_model(moe_class, ep_size: int) -> nn.Module:
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
            expert = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            self.moe = moe_class(DIM, expert, num_experts=EXPERTS, ep_size=ep_size, k=K, min_capacity=4)

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            out, l_aux, _ = self.moe(self.ln2(x))
            return x + out, l_aux

    class MoEGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            mask = torch.triu(torch.full((idx.shape[1],) * 2, float("-inf")), diagonal=1)
            aux = 0.0
            for block in self.blocks:
                x, l_aux = block(x, mask)
                aux = aux + l_aux
            loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
            return loss + 0.01 * aux

    return MoEGPT()


class _A2ACounter:
    """Wraps torch.distributed.all_to_all_single to count the bytes this rank sends to others."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes = 0
        original = dist.all_to_all_single

        def counted(output, input, *args, **kwargs):
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            world = dist.get_world_size(group)
            self.bytes += input.numel() * input.element_size() * (world - 1) // world
            return original(output, input, *args, **kwargs)

        dist.all_to_all_single = counted


def _worker(rank, world, system, ep, stage, steps, warmup, port, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", _run(rank, world, system, ep, stage, steps, warmup)))
    except Exception as err:  # recorded in the results: DeepSpeed may not run every case on CPU
        results.put((rank, "error", f"{type(err).__name__}: {err}"[:600]))


def _run(rank, world, system, ep, stage, steps, warmup):
    import torch.distributed as dist

    if system == "deepspeed":
        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import shardspeed as deepspeed
        from shardspeed.moe.layer import MoE
        from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

        deepspeed.init_distributed()
    counter = _A2ACounter()
    model = build_model(MoE, ep)
    groups = split({"params": list(model.parameters()), "name": "params"})
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (warmup + steps, world * MICRO, SEQ + 1), generator=gen)
    times, per_step_bytes, loss = [], [], None
    for step in range(warmup + steps):
        batch = data[step, rank * MICRO : (rank + 1) * MICRO]
        dist.barrier()
        before, start = counter.bytes, time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            per_step_bytes.append(counter.bytes - before)
    return {"step_s": statistics.median(times), "a2a_bytes": statistics.median(per_step_bytes),
            "loss": loss.item()}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(system, ep, stage, steps, warmup, world=2, timeout=900):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, system, ep, stage, steps, warmup, port, results))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < world:
            rank, status, value = results.get(timeout=timeout)
            got[rank] = (status, value)
            if status == "error":
                break
    except Exception as err:
        got[-1] = ("error", f"timeout or crash: {err}")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    from benchmarks.worker import remove_shared_memory_left_by  # DeepSpeed's /dev/shm files

    remove_shared_memory_left_by(port)
    errors = [v for s, v in got.values() if s == "error"]
    return {"error": errors[0]} if errors else got[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--systems", nargs="*", default=None, help="e.g. shardspeed:2:3 deepspeed:2:2")
    parser.add_argument("--out", default=None)
    parser.add_argument("--table-from", default=None, help="print the table of an earlier moe.json")
    args = parser.parse_args()
    if args.table_from:
        print(summarize(json.loads(Path(args.table_from).read_text())["rounds"]))
        return
    systems = (
        SYSTEMS
        if not args.systems
        else [(s, int(e), int(z)) for s, e, z in (x.split(":") for x in args.systems)]
    )
    rounds: dict[str, list] = {f"{s} ep{e} z{z}": [] for s, e, z in systems}
    for r in range(args.rounds):
        for s, e, z in systems:
            result = run_job(s, e, z, args.steps, args.warmup)
            rounds[f"{s} ep{e} z{z}"].append(result)
            print(f"round {r} {s} ep{e} z{z}: {result}", flush=True)
    table = summarize(rounds)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe.json").write_text(json.dumps({"rounds": rounds, "args": vars(args)}, indent=1))
        (out / "moe.md").write_text(table + "\n")


def summarize(rounds: dict[str, list]) -> str:
    """The table: each system against DeepSpeed at ZeRO-2 and the same ep size (ratio of median step times)."""
    tokens = 2 * MICRO * SEQ

    def median_step(name):
        ok = [x["step_s"] for x in rounds.get(name, []) if "step_s" in x]
        return statistics.median(ok) if ok else None

    lines = ["| system | tokens/s (median) | min-max over rounds | all-to-all bytes/step/rank | vs DeepSpeed (same ep, ZeRO-2) | final loss |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, results in rounds.items():
        ok = [x for x in results if "step_s" in x]
        if not ok:
            lines.append(f"| {name} | error: {results[0]['error']} | | | | |")
            continue
        rates = [tokens / x["step_s"] for x in ok]
        base = median_step("deepspeed " + name.split()[1] + " z2")
        ratio = f"{base / median_step(name):.2f}x" if base else "n/a"
        a2a = statistics.median(x["a2a_bytes"] for x in ok)
        lines.append(f"| {name} | {statistics.median(rates):.0f} | {min(rates):.0f}-{max(rates):.0f} | "
                     f"{a2a / 1024:.1f} KiB | {ratio} | {ok[-1]['loss']:.4f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
