"""`ds_nvme_tune` / `shardspeed-nvme-tune`: sweep async-I/O settings on a folder, print the best `aio` block.

    ds_nvme_tune --nvme_dir /local_nvme --io_size 400M [--sweep_config sweep.json] [--no_read] [--log_dir DIR]

Every combination of the sweep (default: block_size 1M/8M x queue_depth 32/128 x sequential_requests x
single_submit x io_parallel 1/2/4/8, DeepSpeed's default grid; `--sweep_config` is a JSON object of lists
with the same keys) is measured by `io_bench.measure` for reads and for writes, `--loops` times each, one
process per `--nvme_dir`. Each measurement is logged to `--log_dir` (`read/` and `write/`, one file per
combination), and the combination with the best read + write speed is printed as the `aio` config block
DeepSpeed prints (block_size, queue_depth, intra_op_parallelism, single_submit, overlap_events).
`--flush_page_cache` drops the file's cached pages before each read (posix_fadvise, no sudo needed).
`--gpu` and `--gds` are refused: they measure GPU transfers, which this I/O does not do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from types import SimpleNamespace

from shardspeed.tools.io_bench import measure, parse_size

__all__ = ["DEFAULT_SWEEP", "build_parser", "main", "sweep"]

DEFAULT_SWEEP = {
    "block_size": ["1M", "8M"],
    "queue_depth": [32, 128],
    "sequential_requests": [True, False],
    "single_submit": [False, True],
    "io_parallel": [1, 2, 4, 8],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_nvme_tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme_dir", nargs="+", required=True, help="writable folder(s) on the NVMe device(s)")
    p.add_argument("--sweep_config", default=None, help="JSON file: lists of values per setting")
    p.add_argument("--no_read", action="store_true", help="skip read measurements")
    p.add_argument("--no_write", action="store_true", help="skip write measurements")
    p.add_argument("--io_size", default="400M", help="bytes per measurement and folder (K, M, G suffixes)")
    p.add_argument("--gpu", action="store_true", help="refused: GPU transfers are not measured here")
    p.add_argument("--gds", action="store_true", help="refused: GPUDirect Storage is not offered")
    p.add_argument(
        "--flush_page_cache", action="store_true", help="drop the file's cached pages before reads"
    )
    p.add_argument("--log_dir", default="_aio_bench_logs", help="where each measurement is logged")
    p.add_argument("--loops", type=int, default=1, help="timed repetitions per measurement")
    p.add_argument("--verbose", action="store_true", help="print every measurement")
    return p


def _sweep_grid(path: str | None) -> list[dict]:
    grid = DEFAULT_SWEEP
    if path is not None:
        with open(path) as handle:
            grid = json.load(handle)
        unknown = sorted(set(grid) - set(DEFAULT_SWEEP))
        if unknown:
            raise SystemExit(f"ds_nvme_tune: --sweep_config {path}: unknown settings {unknown} "
                             f"(known: {sorted(DEFAULT_SWEEP)})")  # fmt: skip
        grid = {**{k: v[:1] for k, v in DEFAULT_SWEEP.items()}, **grid}
    names = list(grid)
    return [dict(zip(names, values)) for values in itertools.product(*(grid[n] for n in names))]


def _flush(folder: str) -> None:
    """Drop cached pages of the benchmark's files before a read (posix_fadvise DONTNEED, no privilege)."""
    for name in os.listdir(folder):
        if name.startswith("_ds_io_"):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _measure(settings: dict, folders: list[str], args, read: bool) -> float:
    """GB/s of one combination: one process per folder (each its own `io_size`)."""
    speeds = []
    for folder in folders:
        if read and args.flush_page_cache:
            _flush(folder)
        run = SimpleNamespace(
            folder=folder, io_size=parse_size(args.io_size), read=read, multi_process=1, loops=args.loops,
            warmup_loops=0, include_warmup_time=False, validate=False, different_file_each_iteration=False,
            block_size=parse_size(settings["block_size"]), queue_depth=int(settings["queue_depth"]),
            io_parallel=int(settings["io_parallel"]), single_submit=bool(settings["single_submit"]),
            sequential_requests=bool(settings["sequential_requests"]),
        )  # fmt: skip
        speeds.append(measure(run)["gb_per_s"])
    return sum(speeds)


def _log(log_dir: str, kind: str, settings: dict, speed: float) -> None:
    folder = os.path.join(log_dir, kind)
    os.makedirs(folder, exist_ok=True)
    name = "_".join(f"{k}{v}" for k, v in settings.items()) + ".txt"
    with open(os.path.join(folder, name), "w") as handle:
        handle.write(f"{json.dumps(settings)}\nE2E {kind.capitalize()} Speed = {speed:.3f} GB/sec\n")


def sweep(args) -> tuple[dict, dict]:
    """Measure every combination; returns (best settings, {combination text: (read GB/s, write GB/s)})."""
    results: dict[str, tuple[float, float]] = {}
    best, best_total = None, -1.0
    for settings in _sweep_grid(args.sweep_config):
        read = 0.0 if args.no_read else _measure(settings, args.nvme_dir, args, read=True)
        write = 0.0 if args.no_write else _measure(settings, args.nvme_dir, args, read=False)
        for kind, speed, skipped in (("read", read, args.no_read), ("write", write, args.no_write)):
            if not skipped:
                _log(args.log_dir, kind, settings, speed)
        results[json.dumps(settings)] = (read, write)
        if args.verbose:
            print(f"{json.dumps(settings)}: read {read:.3f} GB/s, write {write:.3f} GB/s", flush=True)
        if read + write > best_total:
            best, best_total = settings, read + write
    return best, results


def aio_block(settings: dict) -> dict:
    """The `aio` config block of one combination (keys as DeepSpeed's config)."""
    return {
        "block_size": parse_size(settings["block_size"]),
        "queue_depth": int(settings["queue_depth"]),
        "intra_op_parallelism": int(settings["io_parallel"]),
        "single_submit": bool(settings["single_submit"]),
        "overlap_events": not bool(settings["sequential_requests"]),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("gpu", "gds"):
        if getattr(args, flag):
            raise SystemExit(
                f"ds_nvme_tune: --{flag}: GPU transfers are not measured by shardspeed's async I/O"
            )
    if args.no_read and args.no_write:
        raise SystemExit("ds_nvme_tune: --no_read and --no_write together leave nothing to measure")
    missing = [d for d in args.nvme_dir if not os.path.isdir(d)]
    if missing:
        raise SystemExit(f"ds_nvme_tune: --nvme_dir: not existing folders: {missing}")
    print(f"Running DeepNVMe performance tuning on {args.nvme_dir}")
    best, results = sweep(args)
    read, write = results[json.dumps(best)]
    print(f"Best performance (GB/sec): read = {read:5.2f}, write = {write:5.2f}")
    print(json.dumps({"aio": aio_block(best)}, indent=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
