"""`ds_bench` / `shardspeed-bench`: collective bandwidth over torch.distributed, with DeepSpeed's flags.

    ds_bench --scan --all-reduce --trials 20             # started through the launcher (all local GPUs)
    shardspeed --num_gpus 2 --module shardspeed.tools.comm_bench --all-gather --elements-per-gpu 1048576

Run outside a launcher, the command starts itself through `shardspeed` (as DeepSpeed's `ds_bench` starts
itself through `deepspeed`). Each rank times `--warmups` untimed and `--trials` timed calls of each chosen
collective (all of them when none is chosen) at one message size, or at every power of two up to
2^`--maxsize` bytes with `--scan`, and rank 0 prints, per size, the slowest rank's time per call, the
algorithm bandwidth (bytes each rank contributes / time) and the bus bandwidth (algorithm bandwidth x the
collective's traffic factor, as nccl-tests define it: 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for broadcast and point-to-point), so numbers compare across world sizes.
All-gather and reduce-scatter go through shardspeed's flat collectives, the ones ZeRO uses (on Gloo, whose
native reduce-scatter is slow, one reduce per slice; shardspeed/comm/collectives.py).

The single message size is `--elements-per-gpu` elements, else (on a GPU) `--mem-factor` of the free device
memory divided among the buffers the collective needs, else 2^`--maxsize` bytes. `--backend ccl` (oneCCL) is
not offered; `--dist deepspeed` and `--dist torch` both run torch.distributed's collectives.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["BUS_FACTORS", "build_parser", "main"]

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "pt2pt")
# the bus-bandwidth factor of each collective on n ranks (nccl-tests' definitions)
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "pt2pt": lambda n: 1.0,
}
# buffers of the message size each collective holds at once (for --mem-factor)
_BUFFERS = {
    "all_reduce": 1,
    "all_gather": 2,
    "reduce_scatter": 2,
    "all_to_all": 2,
    "broadcast": 1,
    "pt2pt": 1,
}
_LAUNCHED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", type=int, default=None, help="set by the launcher")
    p.add_argument("--trials", type=int, default=50, help="timed calls per size (default 50)")
    p.add_argument("--warmups", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--maxsize", type=int, default=24, help="largest message, as a power of 2 of bytes")
    p.add_argument("--elements-per-gpu", "--elements_per_gpu", dest="elements_per_gpu", type=int,
                   help="message size in elements per rank (single-size runs)")  # fmt: skip
    p.add_argument("--async-op", "--async_op", dest="async_op", action="store_true",
                   help="issue all trials asynchronously, then wait")  # fmt: skip
    p.add_argument("--bw-unit", "--bw_unit", dest="bw_unit", default="Gbps", choices=["Gbps", "GBps"])
    p.add_argument("--backend", default=None, help="nccl, gloo or mpi (default: the accelerator's)")
    p.add_argument("--dist", default="deepspeed", choices=["deepspeed", "torch"])
    p.add_argument("--scan", action="store_true", help="every power-of-two size up to 2^maxsize bytes")
    p.add_argument("--raw", action="store_true", help="numbers only, no units")
    for op in OPERATIONS:
        flag = op.replace("_", "-")
        p.add_argument(f"--{flag}", f"--{op}", dest=op, action="store_true", help=f"run {op}")
    p.add_argument("--dtype", default="float", help="torch dtype name (float, half, bfloat16, int, ...)")
    p.add_argument("--mem-factor", "--mem_factor", dest="mem_factor", type=float, default=None,
                   help="GPU only: share of free device memory for single-size runs (default 0.4)")  # fmt: skip
    p.add_argument("--debug", action="store_true", help="print every rank's own timings too")
    return p


def _check(args, torch, cuda: bool) -> None:
    """Refuse, by name, what cannot run here (before any process group exists)."""
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"ds_bench: --dtype {args.dtype!r} is not a torch dtype name")
    if args.backend == "ccl":
        raise SystemExit(
            "ds_bench: --backend ccl (oneCCL) is not offered by shardspeed; use nccl, gloo or mpi"
        )
    if args.backend == "nccl" and not cuda:
        raise SystemExit("ds_bench: --backend nccl needs a GPU; on CPU use gloo (the default there)")
    if args.mem_factor is not None and not cuda:
        raise SystemExit(
            "ds_bench: --mem-factor sizes messages from GPU memory; on CPU give --elements-per-gpu"
        )
    smallest = {"trials": 1, "warmups": 0, "maxsize": 1, "elements_per_gpu": 1}
    for name, least in smallest.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise SystemExit(f"ds_bench: --{name.replace('_', '-')} must be at least {least}, got {value}")


def _sizes(args, op: str, torch, dtype, world: int, cuda: bool) -> list[int]:
    """Elements per rank for each measured size."""
    element = torch.empty((), dtype=dtype).element_size()
    if args.scan:  # a multiple of the world size each, so all-to-all and reduce-scatter split evenly
        counts = (max(world, 2**p // element // world * world) for p in range(1, args.maxsize + 1))
        return list(dict.fromkeys(counts))
    if args.elements_per_gpu is not None:
        count = args.elements_per_gpu
    elif cuda:
        free = torch.cuda.mem_get_info()[0] * (0.4 if args.mem_factor is None else args.mem_factor)
        count = int(free // (element * _BUFFERS[op] * (world if op == "all_gather" else 1)))
    else:
        count = max(1, 2**args.maxsize // element)
    return [max(world, count // world * world)]  # a multiple of the world size: even all-to-all splits


def _runner(op: str, numel: int, dtype, device, dist, world: int, rank: int):
    """A function issuing one `op` call (async_op as given) on fresh buffers of `numel` elements per rank."""
    torch = sys.modules["torch"]
    from shardspeed.comm.collectives import all_gather_flat, reduce_scatter_flat

    send = torch.ones(numel, dtype=dtype, device=device)
    if op == "all_reduce":
        return lambda async_op: dist.all_reduce(send, async_op=async_op)
    if op == "all_gather":
        out = torch.empty(numel * world, dtype=dtype, device=device)
        return lambda async_op: all_gather_flat(out, send, async_op=async_op)
    if op == "reduce_scatter":
        out = torch.empty(numel // world, dtype=dtype, device=device)
        return lambda async_op: reduce_scatter_flat(out, send, async_op=async_op)
    if op == "all_to_all":
        out = torch.empty_like(send)
        return lambda async_op: dist.all_to_all_single(out, send, async_op=async_op)
    if op == "broadcast":
        return lambda async_op: dist.broadcast(send, src=0, async_op=async_op)
    if world < 2:
        raise SystemExit("ds_bench: --pt2pt needs at least 2 ranks")
    peer = {0: 1, 1: 0}.get(rank)  # ranks 0 and 1 exchange; the others wait at the barrier below

    def pt2pt(async_op: bool):
        if peer is None:
            return None
        work = dist.isend(send, peer) if rank == 0 else dist.irecv(send, peer)
        return work if async_op else work.wait()

    return pt2pt


def _time_op(call, args, sync) -> float:
    """Seconds per call on this rank: warm-ups untimed, then the trials (all issued first with --async-op)."""
    for _ in range(args.warmups):
        work = call(args.async_op)
        if work is not None and args.async_op:
            work.wait()
    sync()
    started = time.perf_counter()
    works = [call(args.async_op) for _ in range(args.trials)]
    for work in works:
        if work is not None and args.async_op:
            work.wait()
    sync()
    return (time.perf_counter() - started) / args.trials


def _row(op: str, nbytes: int, seconds: float, world: int, args) -> str:
    scale = 8e-9 if args.bw_unit == "Gbps" else 1e-9
    algbw = nbytes / seconds * scale
    busbw = algbw * BUS_FACTORS[op](world)
    if args.raw:
        return f"{nbytes} {seconds * 1e6:.2f} {algbw:.3f} {busbw:.3f}"
    size = f"{nbytes:,}"
    return f"{size:<20}{op:<16}{seconds * 1e6:>14.2f} us{algbw:>14.3f}{busbw:>14.3f}"


def _header(args) -> str:
    return f"{'Size (Bytes)':<20}{'Description':<16}{'Duration':>17}{'Throughput (' + args.bw_unit + ')':>18}{'BusBW (' + args.bw_unit + ')':>14}"


def run(args) -> None:
    """Inside a launched process: measure and print (rank 0)."""
    import torch
    import torch.distributed as dist

    from shardspeed.accelerator import has_cuda
    from shardspeed.comm.init import init_distributed

    cuda = has_cuda()
    _check(args, torch, cuda)
    init_distributed(dist_backend=args.backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = getattr(torch, args.dtype)
    ops = [op for op in OPERATIONS if getattr(args, op)] or list(OPERATIONS)
    if rank == 0:
        print(f"ds_bench: {world} ranks, backend {dist.get_backend()}, dtype {dtype}, {args.trials} trials")
    for op in ops:
        if rank == 0 and not args.raw:
            print(f"\n---- {op} ----\n{_header(args)}")
        for numel in _sizes(args, op, torch, dtype, world, cuda):
            call = _runner(op, numel, dtype, device, dist, world, rank)
            mine = _time_op(call, args, sync)
            slowest = torch.tensor([mine], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if args.debug:
                print(f"rank {rank}: {op} {numel} elements: {mine * 1e6:.2f} us", flush=True)
            if rank == 0:
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                print(_row(op, nbytes, slowest.item(), world, args), flush=True)
            dist.barrier()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not all(name in os.environ for name in _LAUNCHED):
        # Not started by a launcher: start this command through ours, as DeepSpeed's ds_bench does with deepspeed.
        from shardspeed.launcher.runner import main as launch

        return launch(["--module", "shardspeed.tools.comm_bench", *argv])
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
