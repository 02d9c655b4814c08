"""ZeRO-Infinity on one machine: a GPT larger than memory trained with parameters and optimizer on NVMe.

    python benchmarks/zero_infinity.py --layers 32 --hidden 2560 --steps 3 --nvme-path /tmp/infinity-swap

One process (world 1), bf16 parameters, fp32 masters and AdamW. The GPT is built with
`zero.Init(remote_device="nvme")`, so no full copy of it ever exists; training runs at stage 3 with
`offload_param` and `offload_optimizer` both on NVMe. Each system runs in its own process (so its peak RSS
is its own); the same job runs on DeepSpeed 0.19.8 when `--deepspeed-python` can import it (its NVMe path
needs libaio-dev and the JIT-built async_io and cpu_adam ops). Reported:

- peak RSS (getrusage) against the training state (bf16 parameters, fp32 masters, Adam moments);
- seconds per step, split into forward+backward and the optimizer step, and for shardspeed into the time
  the training thread waited on file I/O and the rest (compute);
- bytes the process read from and wrote to the disk per step (/proc/self/io: the same measure for both
  systems) and the throughput that gives, against the disk's own sequential bandwidth measured in the same
  run, before and after training, with fio (`apt-get install fio`; O_DIRECT, the better of 1 MiB requests
  16 deep and 16 MiB requests one at a time) or, without fio, dd (16 MiB blocks);
- shardspeed's I/O path alone (its thread pool writing then reading a file of `--probe-gib` GiB with the run's
  aio settings), and its disk throughput during training: bytes moved over the wall time during which at
  least one of its requests was in the kernel.

Writes benchmarks/results/zero_infinity.md and .json. Heavy on disk (~20 bytes per parameter for each
system, one after the other) and CPU: check `df` first; swap folders are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
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


def disk_bandwidth(folder: str, gib: int) -> dict:
    """The disk's own sequential write and read bandwidth on `gib` GiB, O_DIRECT: with fio, the better of
    two patterns per direction (1 MiB requests 16 deep through libaio, and 16 MiB requests one at a time);
    with dd (16 MiB blocks, one at a time) where fio is not installed."""
    path = os.path.join(folder, "disk-probe")
    out: dict = {"tool": "fio" if shutil.which("fio") else "dd"}
    for name in ("write", "read"):
        rates = {}
        if out["tool"] == "fio":
            for pattern, options in (("1M x16 libaio", ["--bs=1M", "--iodepth=16", "--ioengine=libaio"]),
                                     ("16M x1 psync", ["--bs=16M", "--iodepth=1", "--ioengine=psync"])):  # fmt: skip
                done = subprocess.run(
                    ["fio", "--name=probe", f"--filename={path}", f"--size={gib}G", f"--rw={name}", "--direct=1",
                     "--output-format=json", *options],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                rates[pattern] = json.loads(done.stdout)["jobs"][0][name]["bw_bytes"]
        else:
            args = ["if=/dev/zero", f"of={path}", "oflag=direct"] if name == "write" else [
                f"if={path}", "of=/dev/null", "iflag=direct"]  # fmt: skip
            started = time.perf_counter()
            subprocess.run(["dd", *args, "bs=16M", f"count={gib * 64}"], check=True, capture_output=True)
            rates["16M x1 dd"] = gib * 2**30 / (time.perf_counter() - started)
        out[f"{name}_patterns"] = rates
        out[f"{name}_bytes_per_s"] = max(rates.values())
    os.unlink(path)
    return out


def aio_path_alone(folder: str, gib: int, aio: dict) -> dict:
    """shardspeed's thread-pool I/O on its own: one `gib`-GiB tensor written to a file, then read back, in
    256 MiB requests all submitted at once (as the swappers keep several sub-groups in flight)."""
    from shardspeed.zero.swap.aio import AioSettings, AsyncFileIO, aligned_empty

    settings = AioSettings(block_size=aio["block_size"], queue_depth=aio["queue_depth"],
                           thread_count=aio["intra_op_parallelism"])  # fmt: skip
    io = AsyncFileIO(settings)
    piece = 256 * 2**20
    buffers = [aligned_empty(piece, torch.uint8) for _ in range(4 * gib)]
    for b in buffers:
        b.fill_(7)
    out = {}
    for name in ("write", "read"):
        started = time.perf_counter()
        requests = [
            (io.write if name == "write" else io.read)(b, os.path.join(folder, f"aio-probe-{i}"))
            for i, b in enumerate(buffers)
        ]
        for request in requests:
            request.wait()
        out[f"{name}_bytes_per_s"] = gib * 2**30 / (time.perf_counter() - started)
    io.close()
    for i in range(len(buffers)):
        os.unlink(os.path.join(folder, f"aio-probe-{i}"))
    return out


def job_config(args, swap: str, system: str = "shardspeed") -> dict:
    """The same DeepSpeed config for both systems, but for one key whose unit differs: the optimizer's
    `buffer_count` counts sub-groups in memory here and pinned buffers (one per tensor: master, two moments,
    gradient) in DeepSpeed, so 3 sub-groups in flight are 3 here and 12 there."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth, "intra_op_parallelism": 4,
                "single_submit": False, "overlap_events": True},
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group,
            "reduce_bucket_size": args.sub_group,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": args.sub_group,
            "stage3_param_persistence_threshold": 100_000,
            # DeepSpeed needs a buffer to hold the largest parameter (the MLP's 4h x h or the embedding)
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_count": 4,
                              "buffer_size": max(args.sub_group, 4 * args.hidden**2, args.vocab * args.hidden)},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "buffer_count": 12 if system == "deepspeed" else 3,
                                  "pipeline_read": True, "pipeline_write": True},
        },
    }  # fmt: skip


def _disk_io() -> tuple[int, int]:
    """Bytes this process (all its threads) read from and wrote to storage so far (/proc/self/io)."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            values[key] = int(value)
    return values["read_bytes"], values["write_bytes"]


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM: unlike getrusage's ru_maxrss, not inherited from the
    process that started it)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def worker(system: str, args) -> dict:
    """Build the GPT on NVMe with `system`'s zero.Init, train `args.steps` steps, measure each."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    swap = os.path.join(args.nvme_path, system)
    os.makedirs(swap, exist_ok=True)
    config = job_config(args, swap, system)
    if system == "deepspeed":
        import deepspeed as lib

        lib.init_distributed(dist_backend="gloo")
    else:
        import shardspeed as lib
    torch.manual_seed(0)
    started = time.perf_counter()
    with lib.zero.Init(remote_device="nvme", config_dict_or_path=config):
        model = GPT(args.layers, args.hidden, args.hidden // 128, args.vocab, args.seq)
    built = time.perf_counter() - started
    built_rss = _peak_rss()
    numel = sum(p.ds_numel for p in model.parameters())
    print(f"{system}: built {numel / 1e9:.2f}B parameters in {built:.0f} s, peak RSS {built_rss / 2**30:.2f} GiB",
          flush=True)  # fmt: skip
    if system == "deepspeed":
        engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
        ios = []
    else:
        engine, *_ = lib.initialize(model=model, config=config)
        ios = [engine.optimizer.nvme.io]  # one pool per rank, shared by both tiers
    ready = time.perf_counter() - started
    tokens = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    steps = []
    for step in range(args.steps):
        counters = [(io.seconds_waiting, io.seconds_busy, io.bytes_read + io.bytes_written) for io in ios]
        disk = _disk_io()
        print(f"{system} step {step}: forward and backward", flush=True)
        t0 = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        t1 = time.perf_counter()
        print(f"{system} step {step}: optimizer step", flush=True)
        engine.step()
        t2 = time.perf_counter()
        read, written = (after - before for after, before in zip(_disk_io(), disk))
        row = {"seconds": t2 - t0, "forward_backward": t1 - t0, "optimizer": t2 - t1, "read": read,
               "written": written, "loss": loss.item()}  # fmt: skip
        if ios:
            (wait0, busy0, moved0), io = counters[0], ios[0]
            row.update(io_wait=io.seconds_waiting - wait0, io_busy=io.seconds_busy - busy0,
                       requested=io.bytes_read + io.bytes_written - moved0)  # fmt: skip
            row["compute"] = row["seconds"] - row["io_wait"]
        steps.append(row)
        print(f"{system} step {step}: {row['seconds']:.1f} s (forward+backward {row['forward_backward']:.1f}, "
              f"step {row['optimizer']:.1f}), read {read / 2**30:.1f} GiB, wrote {written / 2**30:.1f} GiB, "
              f"loss {row['loss']:.4f}, peak RSS {_peak_rss() / 2**30:.2f} GiB", flush=True)  # fmt: skip
    swap_bytes = sum(f.stat().st_size for f in Path(swap).rglob("*") if f.is_file())
    peak = _peak_rss()
    engine.destroy()
    return {"params": numel, "build_seconds": built, "build_peak_rss": built_rss, "ready_seconds": ready,
            "steps": steps, "swap_bytes": swap_bytes, "peak_rss": peak, "peak_rss_with_destroy": _peak_rss()}  # fmt: skip


def run_worker(python: str, system: str, args, timeout: float) -> dict:
    """One system's job in its own process; its JSON result, or how it ended."""
    out = Path(args.nvme_path) / f"{system}.json"
    command = [python, __file__, "--worker", system, "--result", str(out)]
    command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k in ("layers", "hidden", "vocab", "seq", "steps", "sub_group", "nvme_path", "queue_depth",
                         "block_size")]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    log = Path(args.nvme_path) / f"{system}.log"
    with open(log, "w") as sink:
        job = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            code = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
            code = None
    text = log.read_text(errors="replace")
    print(text, flush=True)
    if code == 0 and out.exists():
        return json.loads(out.read_text())
    # the job's own progress lines and errors, not the libraries' deprecation chatter
    lines = [line for line in text.splitlines() if "Warning" not in line and "return func(" not in line]
    how = {None: f"stopped after the {timeout:.0f} s limit",
           -9: "killed by SIGKILL (on this machine: the kernel's out-of-memory killer, see dmesg)"}  # fmt: skip
    return {
        "error": [*lines[-10:], how.get(code, f"exit code {code}"), *_oom_record(job.pid)],
        "returncode": code,
    }


def _oom_record(pid: int) -> list[str]:
    """The kernel's out-of-memory record of process `pid`, if it has one (dmesg may need privileges)."""
    try:
        kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in kernel.splitlines() if f"Killed process {pid} " in line]


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
    parser.add_argument("--sub-group", type=int, default=20_000_000)
    parser.add_argument("--nvme-path", default="/tmp/infinity-swap")
    parser.add_argument("--probe-gib", type=int, default=4)
    parser.add_argument("--queue-depth", type=int, default=16, help="aio.queue_depth (both systems)")
    parser.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size (both systems)")
    parser.add_argument("--deepspeed-python", default="/work/benchvenv/bin/python")
    parser.add_argument("--deepspeed-timeout", type=float, default=3600)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="zero_infinity", help="result files: <out>/<name>.md and .json")
    parser.add_argument("--worker", choices=["shardspeed", "deepspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md from the saved .json")
    args = parser.parse_args()
    if args.report_only:
        result = json.loads((Path(args.out) / f"{args.name}.json").read_text())
        (Path(args.out) / f"{args.name}.md").write_text(report(result, args))
        return
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args.worker, args)))
        return
    os.makedirs(args.nvme_path, exist_ok=True)
    result = {"load_before": _load(), "cores": os.cpu_count(),
              "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30}  # fmt: skip
    result["disk"] = disk_bandwidth(args.nvme_path, args.probe_gib)
    result["aio_alone"] = aio_path_alone(args.nvme_path, args.probe_gib, job_config(args, "")["aio"])
    print("disk:", result["disk"], "aio alone:", result["aio_alone"], flush=True)
    result["shardspeed"] = run_worker(sys.executable, "shardspeed", args, timeout=7200)
    if args.deepspeed_python and os.path.exists(args.deepspeed_python):
        result["deepspeed"] = run_worker(args.deepspeed_python, "deepspeed", args, args.deepspeed_timeout)
    result["disk_after"] = disk_bandwidth(args.nvme_path, args.probe_gib)
    result["load_after"] = _load()
    shutil.rmtree(args.nvme_path, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text(report(result, args))
    print(report(result, args))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _disk_seconds(step: dict, disk: dict) -> float:
    """How long the disk needs for this step's reads and writes at its own sequential speeds."""
    return step["read"] / disk["read_bytes_per_s"] + step["written"] / disk["write_bytes_per_s"]


def _system_rows(name: str, r: dict, disk: dict, strict: dict, ours: bool) -> list[str]:
    rows = []
    for i, s in enumerate(r["steps"]):
        share = 100 * _disk_seconds(s, disk) / s["seconds"]
        cells = [f"{name} {i}", f"{s['seconds']:.1f}", f"{s['forward_backward']:.1f}", f"{s['optimizer']:.1f}",
                 f"{_gib(s['read'])} / {_gib(s['written'])}", f"{share:.0f}%"]  # fmt: skip
        if ours and s["io_busy"]:
            busy = 100 * _disk_seconds(s, disk) / s["io_busy"]
            stricter = 100 * _disk_seconds(s, strict) / s["io_busy"]
            cells += [f"{s['io_wait']:.1f}", f"{s['compute']:.1f}", f"{s['io_busy']:.1f}", f"{busy:.0f}%",
                      f"{stricter:.0f}%"]  # fmt: skip
        else:
            cells += [""] * 5
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def report(result: dict, args) -> str:
    ours, ds = result["shardspeed"], result.get("deepspeed")
    alone = result["aio_alone"]
    keys = ("write_bytes_per_s", "read_bytes_per_s")
    # The disk's own sequential bandwidth (fio or dd; the mean of before and after training), and a stricter
    # reference: that or what our own I/O path reached alone (many files at once), whichever is higher.
    disk = {k: (result["disk"][k] + result["disk_after"][k]) / 2 for k in keys}
    strict = {k: max(disk[k], alone[k]) for k in keys}
    tool = result["disk"]["tool"]
    lines = [
        f"# ZeRO-Infinity: a GPT larger than memory on one {result['cores']}-core, "
        f"{result['memory_gib']:.0f} GiB machine",
        "",
        f"`python benchmarks/zero_infinity.py --layers {args.layers} --hidden {args.hidden} --steps {args.steps} "
        f"--sub-group {args.sub_group}` (world 1, bf16 parameters, fp32 masters and AdamW, stage 3, parameters "
        f"and optimizer on NVMe with `max_in_cpu` 0, sequence {args.seq}, micro-batch 1; built with "
        f'`zero.Init(remote_device="nvme")`). Load average {result["load_before"]} before, '
        f"{result['load_after']} after.",
        "",
        f"**Disk**, its own sequential bandwidth ({tool}, O_DIRECT, the better of its patterns, mean of before "
        f"and after training): write {disk['write_bytes_per_s'] / 2**20:.0f} MiB/s, read "
        f"{disk['read_bytes_per_s'] / 2**20:.0f} MiB/s. Patterns (MiB/s, before / after): "
        + "; ".join(
            f"{d} {pattern} {result['disk'][f'{d}_patterns'][pattern] / 2**20:.0f} / "
            f"{result['disk_after'][f'{d}_patterns'][pattern] / 2**20:.0f}"
            for d in ("write", "read")
            for pattern in result["disk"][f"{d}_patterns"]
        )
        + ". This is a virtual disk: the same probe varies by up to 2x between runs minutes apart.",
        "",
        f"shardspeed's I/O path alone (its thread pool, the run's aio settings, {args.probe_gib} GiB in 256 MiB "
        f"files all in flight): write {alone['write_bytes_per_s'] / 2**20:.0f} MiB/s, read "
        f"{alone['read_bytes_per_s'] / 2**20:.0f} MiB/s. The *stricter reference* below is, per direction, the "
        f"higher of this and the disk's figure: write {strict['write_bytes_per_s'] / 2**20:.0f} MiB/s, read "
        f"{strict['read_bytes_per_s'] / 2**20:.0f} MiB/s.",
        "",
        "| system | parameters | training state | swap files | built in | peak RSS building | peak RSS training "
        "| peak RSS with destroy() |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("shardspeed", ours), ("DeepSpeed 0.19.8", ds)):
        if r is None or "error" in r:
            continue
        state = 14 * r["params"]  # bf16 parameter 2 + fp32 master 4 + Adam moments 8
        lines.append(f"| {name} | {r['params'] / 1e9:.2f} B | {_gib(state)} GiB | {_gib(r['swap_bytes'])} GiB | "
                     f"{r['build_seconds']:.0f} s | {_gib(r['build_peak_rss'])} GiB | "
                     f"**{r['peak_rss'] / 2**30:.2f} GiB** | {r.get('peak_rss_with_destroy', 0) / 2**30:.2f} GiB |")  # fmt: skip
    lines += [
        "",
        "Per step: seconds; bytes the process read/wrote on the disk (/proc/self/io); *disk share* = the time "
        "the disk needs for those bytes at its own sequential speeds over the step's time. shardspeed also "
        "reports the time the training thread waited on I/O (in `wait()` or on a full queue), the rest "
        "(compute), the wall time during which its I/O was in the kernel (*I/O busy*), and the disk share over "
        "that busy time (against the disk, and against the stricter reference).",
        "",
        "| step | seconds | forward+backward | optimizer | GiB read / written | disk share of step | I/O wait "
        "| compute | I/O busy | disk share while busy | stricter |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *_system_rows("shardspeed", ours, disk, strict, ours=True),
    ]
    if ds is not None and "error" not in ds:
        lines += _system_rows("DeepSpeed", ds, disk, strict, ours=False)
    steady = ours["steps"][1:] or ours["steps"]
    need = sum(_disk_seconds(s, disk) for s in steady)
    need_strict = sum(_disk_seconds(s, strict) for s in steady)
    busy = sum(s["io_busy"] for s in steady)
    total = sum(s["seconds"] for s in steady)
    lines += [
        "",
        f"shardspeed, steps after the first: the disk needs {need:.0f} s at its own sequential speeds for what "
        f"they moved ({need_strict:.0f} s at the stricter reference); their I/O was in flight for {busy:.0f} s of "
        f"{total:.0f} s. While in flight it ran at **{100 * need / busy:.0f}%** of the disk's bandwidth "
        f"({100 * need_strict / busy:.0f}% of the stricter reference); over the whole step, compute included, "
        f"{100 * need / total:.0f}% ({100 * need_strict / total:.0f}%).",
        "",
    ]
    if ds is None:
        lines.append("DeepSpeed 0.19.8: not run (no `--deepspeed-python`).")
    elif "error" in ds:
        lines += ["DeepSpeed 0.19.8 on the same job stopped with:", "", "```", *ds["error"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
