"""ZeRO-Infinity on one machine: a GPT larger than memory trained with parameters and optimizer on NVMe.

    python benchmarks/zero_infinity.py --layers 32 --hidden 2560 --steps 3 --nvme-path /tmp/infinity-swap

One process (world 1), bf16 by default (`--dtype fp32`: the fp32 gradient shard alone is 4 bytes per
parameter of memory). The GPT is built with `zero.Init(remote_device="nvme")`, so no full copy of it ever
exists; training runs at stage 3 with `offload_param` and `offload_optimizer` both on NVMe. Reported:

- peak RSS (getrusage) against the fp32 training state (16 bytes per parameter);
- seconds per step, split into I/O (time the training thread waited on file reads/writes) and compute
  (the rest: forward, backward, the Adam step);
- bytes moved per step and the throughput that gives, against the disk's own sequential write and read
  bandwidth measured in the same run with `dd` (O_DIRECT, 16 MiB blocks, 4 GiB);
- DeepSpeed 0.19.8 on the same job, or the exact error it stops with (`--deepspeed-python`).

Writes benchmarks/results/zero_infinity.md and .json. Heavy on disk (16 bytes per parameter) and CPU:
check `df` first; the swap folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def disk_bandwidth(folder: str, gib: int = 4) -> dict:
    """Sequential write then read of `gib` GiB with dd, O_DIRECT, 16 MiB blocks (the disk's own figure)."""
    path = os.path.join(folder, "dd-probe")
    out = {}
    for name, args in (
        ("write", ["if=/dev/zero", f"of={path}", "oflag=direct"]),
        ("read", [f"if={path}", "of=/dev/null", "iflag=direct"]),
    ):
        started = time.perf_counter()
        subprocess.run(["dd", *args, "bs=16M", f"count={gib * 64}"], check=True, capture_output=True)
        out[f"{name}_bytes_per_s"] = gib * 2**30 / (time.perf_counter() - started)
    os.unlink(path)
    return out


def _ios(engine) -> list:
    return [engine.optimizer.nvme.io, engine.optimizer.coordinator.tier.io]


def run_shardspeed(args) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    import shardspeed

    swap = args.nvme_path
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "aio": {"block_size": 1 << 20, "queue_depth": 16, "intra_op_parallelism": 4},
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group,
            "reduce_bucket_size": args.sub_group,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_count": 4,
                              "buffer_size": args.sub_group},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "buffer_count": 3,
                                  "pipeline_read": True, "pipeline_write": True},
        },
    }  # fmt: skip
    torch.manual_seed(0)
    started = time.perf_counter()
    with shardspeed.zero.Init(remote_device="nvme", config_dict_or_path=config):
        model = GPT(args.layers, args.hidden, args.hidden // 128, args.vocab, args.seq)
    built = time.perf_counter() - started
    numel = sum(p.ds_numel for p in model.parameters())
    print(f"built {numel / 1e9:.2f}B parameters in {built:.0f} s, peak RSS {_peak_rss() / 2**30:.2f} GiB")
    engine, *_ = shardspeed.initialize(model=model, config=config)
    ready = time.perf_counter() - started
    tokens = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    steps = []
    for step in range(args.steps):
        before = [(io.bytes_read, io.bytes_written, io.seconds_waiting) for io in _ios(engine)]
        t0 = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        after = [(io.bytes_read, io.bytes_written, io.seconds_waiting) for io in _ios(engine)]
        moved = sum(a[0] - b[0] + a[1] - b[1] for a, b in zip(after, before))
        waited = sum(a[2] - b[2] for a, b in zip(after, before))
        row = {"seconds": t2 - t0, "forward_backward": t1 - t0, "optimizer": t2 - t1, "io_wait": waited,
               "compute": t2 - t0 - waited, "bytes_moved": moved, "loss": loss.item(),
               "read": sum(a[0] - b[0] for a, b in zip(after, before)),
               "written": sum(a[1] - b[1] for a, b in zip(after, before))}  # fmt: skip
        steps.append(row)
        print(f"step {step}: {row['seconds']:.1f} s (I/O wait {waited:.1f} s), {moved / 2**30:.1f} GiB moved, "
              f"loss {row['loss']:.4f}, peak RSS {_peak_rss() / 2**30:.2f} GiB", flush=True)  # fmt: skip
    disk = engine.optimizer.nvme.disk_bytes() + engine.optimizer.coordinator.tier.disk_bytes()
    engine.destroy()
    return {"params": numel, "build_seconds": built, "ready_seconds": ready, "steps": steps,
            "swap_bytes": disk, "peak_rss": _peak_rss()}  # fmt: skip


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


DEEPSPEED_PROBE = """
import deepspeed
from deepspeed.ops.op_builder import AsyncIOBuilder
builder = AsyncIOBuilder()
print("compatible:", builder.is_compatible(verbose=True))
builder.load()
print("aio loaded")
"""


def run_deepspeed(python: str) -> dict:
    """DeepSpeed's NVMe path needs its async_io op (libaio + JIT build): try to load it, record the outcome."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        done = subprocess.run([python, "-c", DEEPSPEED_PROBE], capture_output=True, text=True, env=env,
                              timeout=1800)  # fmt: skip
    except subprocess.TimeoutExpired as error:  # its JIT build on a loaded 2-core machine
        output = (error.stdout or b"") + (error.stderr or b"")
        text = output.decode(errors="replace") if isinstance(output, bytes) else output
        return {
            "returncode": None,
            "output_tail": [*text.strip().splitlines()[-10:], "timed out after 1800 s"],
        }
    tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
    return {"returncode": done.returncode, "output_tail": tail}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--sub-group", type=int, default=50_000_000)
    parser.add_argument("--nvme-path", default="/tmp/infinity-swap")
    parser.add_argument("--dd-gib", type=int, default=4)
    parser.add_argument("--deepspeed-python", default="/work/benchvenv/bin/python")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    result = {"load_before": _load(), "cores": os.cpu_count(),
              "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30}  # fmt: skip
    result["disk"] = disk_bandwidth(args.nvme_path, args.dd_gib)
    print("disk:", {k: f"{v / 2**20:.0f} MiB/s" for k, v in result["disk"].items()}, flush=True)
    result["shardspeed"] = run_shardspeed(args)
    result["disk_after"] = disk_bandwidth(args.nvme_path, args.dd_gib)
    result["load_after"] = _load()
    if args.deepspeed_python and os.path.exists(args.deepspeed_python):
        result["deepspeed"] = run_deepspeed(args.deepspeed_python)
    shutil.rmtree(args.nvme_path, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "zero_infinity.json").write_text(json.dumps(result, indent=1))
    (out / "zero_infinity.md").write_text(report(result, args))
    print(report(result, args))


def report(result: dict, args) -> str:
    ours = result["shardspeed"]
    disk = result["disk"]
    both = {k: (disk[k] + result["disk_after"][k]) / 2 for k in disk}
    rows = []
    for i, s in enumerate(ours["steps"]):
        rate = s["bytes_moved"] / s["seconds"]
        rows.append(f"| {i} | {s['seconds']:.1f} | {s['compute']:.1f} | {s['io_wait']:.1f} | "
                    f"{s['read'] / 2**30:.1f} / {s['written'] / 2**30:.1f} | {rate / 2**20:.0f} |")  # fmt: skip
    steady = ours["steps"][1:] or ours["steps"]
    reads = sum(s["read"] for s in steady)
    writes = sum(s["written"] for s in steady)
    secs = sum(s["seconds"] for s in steady)
    # what the disk could do for this mix of reads and writes, at its own sequential speeds
    floor = reads / both["read_bytes_per_s"] + writes / both["write_bytes_per_s"]
    grad = 2 if args.dtype == "bf16" else 4
    state = grad + 12
    ds = result.get("deepspeed")
    ds_text = "not run" if ds is None else (
        "its async_io op loaded" if ds["returncode"] == 0 else "it stopped with:\n\n```\n"
        + "\n".join(ds["output_tail"]) + "\n```"
    )  # fmt: skip
    return f"""# ZeRO-Infinity: a {ours["params"] / 1e9:.2f}B-parameter GPT on one {result["cores"]}-core machine

`python benchmarks/zero_infinity.py --layers {args.layers} --hidden {args.hidden} --steps {args.steps} \
--sub-group {args.sub_group} --dtype {args.dtype}` (world 1, stage 3, parameters and optimizer on NVMe,
sequence {args.seq}).
Machine: {result["cores"]} cores, {result["memory_gib"]:.0f} GiB RAM, shared with other users' jobs (load
average {result["load_before"]} before, {result["load_after"]} after): timings are noisy.

- Training state ({args.dtype} parameters, fp32 masters, Adam moments): {state * ours["params"] / 2**30:.1f} GiB; swap files
  at the end: {ours["swap_bytes"] / 2**30:.1f} GiB.
- Peak RSS: **{ours["peak_rss"] / 2**30:.2f} GiB** (target < 12 GiB); it includes the {args.dtype} gradient
  shard ({grad * ours["params"] / 2**30:.1f} GiB), which stays in memory between backward and step.
- Built with zero.Init in {ours["build_seconds"]:.0f} s; engine ready after {ours["ready_seconds"]:.0f} s.
- Disk (dd, O_DIRECT, 16 MiB blocks, mean of before/after): write {both["write_bytes_per_s"] / 2**20:.0f} MiB/s,
  read {both["read_bytes_per_s"] / 2**20:.0f} MiB/s.

| step | seconds | compute | I/O wait | GiB read / written | MiB/s moved |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Steps after the first: {(reads + writes) / 2**30:.1f} GiB moved in {secs:.0f} s. Moving that at the disk's own
sequential speeds would take {floor:.0f} s, so the I/O ran at **{100 * floor / secs:.0f}%** of the disk's
bandwidth over the whole step (compute included), and the I/O wait is the part of the step not overlapped.

DeepSpeed 0.19.8 (`/work/benchvenv`, CPU accelerator): {ds_text}
"""


if __name__ == "__main__":
    main()
