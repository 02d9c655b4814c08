"""`ds_io` / `shardspeed-io`: file read/write speed of the NVMe tier's async I/O, with DeepSpeed's flags.

    ds_io --folder /local_nvme --io_size 400M --block_size 1M --queue_depth 32 --io_parallel 2 [--read]

Each of `--multi_process` processes moves `--io_size` bytes between a page-aligned host buffer and its own
file in `--folder` through `shardspeed.zero.swap.aio.AsyncFileIO` (the thread pool over preadv/pwritev that
ZeRO-Infinity uses), `--loops` times after `--warmup_loops` untimed rounds, and the command prints the
end-to-end speed the way DeepSpeed's `ds_io` does (`E2E Write Speed = ... GB/sec`), which `ds_nvme_tune` reads.
A read run first writes the file it reads. `--validate` checks the bytes that come back.

Flag mapping: `--block_size`, `--queue_depth`, `--io_parallel` (threads), `--single_submit` and
`--sequential_requests` (no overlap: each request is waited for) are the `aio` config keys of the same
meaning. `--engine` accepts only `aio_handle` (DeepSpeed's default, the one engine this I/O has). GPU buffers
and GPUDirect Storage (`--gpu`, `--use_gds`, `--slow_bounce_buffer`, `--folder_to_device_mapping`) and
torch.save-based engines (`--torch_legacy_save`, `--fast_io_size`, `--use_accelerator_pin_memory`) are
refused by name.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

__all__ = ["build_parser", "main", "measure", "parse_size"]

_REFUSED = {
    "folder_to_device_mapping": "GPU device mappings are not offered; use --folder",
    "fast_io_size": "the torch fast-I/O engine is not offered (only aio_handle)",
    "gpu": "GPU buffers are not offered by ds_io here (it measures host <-> file transfers)",
    "use_gds": "GPUDirect Storage is not offered (nothing is compiled)",
    "slow_bounce_buffer": "GPU bounce buffers are not offered",
    "torch_legacy_save": "torch.save engines are not offered (only aio_handle)",
    "use_accelerator_pin_memory": "accelerator pinned buffers are not offered (buffers are page-aligned host memory)",
}


def parse_size(text: str) -> int:
    """'400M' -> 400 * 2**20 bytes (K, M, G suffixes, as DeepSpeed's)."""
    text = str(text).strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"expected a positive byte count like 4096, 1M or 2G, got {text!r}")
    return int(digits) * scale


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_io", description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", help="folder for the I/O files")
    p.add_argument("--folder_to_device_mapping", nargs="+", default=[], help="refused: GPU mappings")
    p.add_argument("--io_size", required=True, help="bytes per process (K, M, G suffixes)")
    p.add_argument("--fast_io_size", default=None, help="refused: torch fast-I/O engine buffer")
    p.add_argument("--read", action="store_true", help="measure reads (default: writes)")
    p.add_argument("--multi_process", type=int, default=1, help="processes, each with its own file")
    p.add_argument("--block_size", default="1M", help="bytes per request piece (aio.block_size)")
    p.add_argument(
        "--queue_depth", type=int, default=32, help="pieces in flight per thread (aio.queue_depth)"
    )
    p.add_argument("--single_submit", action="store_true", help="issue pieces one by one (aio.single_submit)")
    p.add_argument("--sequential_requests", action="store_true",
                   help="wait for each request before the next (aio.overlap_events false)")  # fmt: skip
    p.add_argument("--validate", action="store_true", help="check the bytes read back")
    p.add_argument("--engine", default="aio_handle", help="aio_handle (the only engine here)")
    p.add_argument("--loops", type=int, default=3, help="timed repetitions")
    p.add_argument("--io_parallel", type=int, default=None, help="threads (aio.intra_op_parallelism)")
    p.add_argument("--warmup_loops", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--include_warmup_time", action="store_true", help="count the warm-up rounds too")
    p.add_argument("--different_file_each_iteration", action="store_true", help="a new file every round")
    for flag in list(_REFUSED)[2:]:  # the switches (the two options above take values)
        p.add_argument(f"--{flag}", action="store_true", help=f"refused: {_REFUSED[flag]}")
    return p


def check(args) -> None:
    """Refuse, by name, what this command does not offer; check the values."""
    for flag, reason in _REFUSED.items():
        if getattr(args, flag):
            raise SystemExit(f"ds_io: --{flag}: {reason}")
    if args.folder_to_device_mapping:
        raise SystemExit(
            "ds_io: --folder_to_device_mapping: GPU device mappings are not offered; use --folder"
        )
    if args.fast_io_size is not None:
        raise SystemExit("ds_io: --fast_io_size: the torch fast-I/O engine is not offered (only aio_handle)")
    if args.engine != "aio_handle":
        raise SystemExit(
            f"ds_io: --engine {args.engine!r}: only aio_handle is offered (shardspeed's async I/O)"
        )
    if not args.folder or not os.path.isdir(args.folder):
        raise SystemExit(f"ds_io: --folder {args.folder!r}: not an existing folder")
    smallest = {"multi_process": 1, "queue_depth": 1, "loops": 1, "io_parallel": 1, "warmup_loops": 0}
    for name, least in smallest.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise SystemExit(f"ds_io: --{name} must be at least {least}, got {value}")
    for name in ("io_size", "block_size"):
        try:
            setattr(args, name, parse_size(getattr(args, name)))
        except ValueError as error:
            raise SystemExit(f"ds_io: --{name}: {error}") from None


def _settings(args):
    from shardspeed.zero.swap.aio import AioSettings

    return AioSettings(
        block_size=args.block_size,
        queue_depth=args.queue_depth,
        thread_count=args.io_parallel or 1,
        single_submit=args.single_submit,
        overlap_events=not args.sequential_requests,
    )


def _worker(args, index: int, results) -> None:
    """One process: its own buffer and file; puts (seconds of the timed rounds, bytes moved, valid)."""
    import torch

    from shardspeed.zero.swap.aio import AsyncFileIO, aligned_empty

    io = AsyncFileIO(_settings(args))
    buffer = aligned_empty(args.io_size, torch.uint8)
    pattern = torch.arange(args.io_size, dtype=torch.int64).remainder_(251).to(torch.uint8)
    buffer.copy_(pattern)
    paths = []
    valid, seconds = True, 0.0
    try:
        for round_index in range(args.warmup_loops + args.loops):
            name = (
                f"_ds_io_{os.getpid()}_{index}_{round_index if args.different_file_each_iteration else 0}.bin"
            )
            path = os.path.join(args.folder, name)
            paths.append(path)
            if args.read and not os.path.exists(path):
                io.write(buffer, path).wait()  # the file a read round reads (not timed)
                buffer.zero_()
            started = time.perf_counter()
            (io.read(buffer, path) if args.read else io.write(buffer, path)).wait()
            if round_index >= args.warmup_loops or args.include_warmup_time:
                seconds += time.perf_counter() - started
            if args.read and args.validate:
                valid = valid and torch.equal(buffer, pattern)
        if not args.read and args.validate:
            check_buffer = aligned_empty(args.io_size, torch.uint8)
            io.read(check_buffer, paths[-1]).wait()
            valid = torch.equal(check_buffer, pattern)
    finally:
        io.close()
        for path in set(paths):
            if os.path.exists(path):
                os.remove(path)
    rounds = args.loops + (args.warmup_loops if args.include_warmup_time else 0)
    results.put((seconds, args.io_size * rounds, valid))


def measure(args) -> dict:
    """Run the processes; returns bytes, seconds (the slowest process), GB/s and whether all validated."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(args, i, results)) for i in range(args.multi_process)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=3600) for _ in workers]
    for worker in workers:
        worker.join()
        if worker.exitcode != 0:
            raise SystemExit(f"ds_io: an I/O process exited with code {worker.exitcode}")
    seconds = max(o[0] for o in outcomes)
    total = sum(o[1] for o in outcomes)
    return {
        "bytes": total,
        "seconds": seconds,
        "gb_per_s": total / seconds / 1e9,
        "valid": all(o[2] for o in outcomes),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check(args)
    result = measure(args)
    kind = "Read" if args.read else "Write"
    rounds = args.loops + (args.warmup_loops if args.include_warmup_time else 0)
    print(
        f"ds_io: {args.multi_process} process(es) x {args.io_size} bytes x {rounds} round(s), {kind.lower()}s"
    )
    print(f"E2E {kind} Latency = {result['seconds'] / rounds * 1e3:.3f} ms")
    print(f"E2E {kind} Speed = {result['gb_per_s']:.3f} GB/sec")
    if args.validate:
        print(f"Validation: {'passed' if result['valid'] else 'FAILED'}")
        return 0 if result["valid"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
