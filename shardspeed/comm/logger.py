"""The comms logger (`comms_logger` block, `deepspeed.comm.configure` / `log_summary`): op, message size and
latency of every collective the library issues and of those users issue through `shardspeed.comm`.

Off by default, and then free: collectives check one module global (`active()` is None) and call torch
directly; nothing is wrapped, hooked or synchronised. On, each profiled op is timed between two device
synchronisations and an asynchronous op is waited for inside the timing (as DeepSpeed does, logging trades
overlap for exact latencies).

Message size is the bytes of the whole collective buffer: the tensor for all_reduce/broadcast/reduce, the
gathered (or to-be-scattered) flat buffer of world_size shards for all_gather/reduce_scatter. Bandwidths
follow DeepSpeed's (and nccl-tests') conventions: algbw = size / latency; busbw = algbw x 2(n-1)/n for
all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for point-to-point and rooted ops.

Bytes are also counted by where they travel (`bytes_by_locality`): a collective whose group lies inside one
node (comm/nodes.py's `NodeLayout`: the launcher's ranks per node, or `SHARDSPEED_RANKS_PER_NODE`) counts as
`intra_node`, any other as `inter_node` — the split ZeRO++ is about.
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardspeed import accelerator
from shardspeed.comm.nodes import NodeLayout
from shardspeed.utils.logging import log_dist

__all__ = ["CommsLogger", "active", "configure", "log_summary", "trim_mean"]

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


@dataclass
class OpRecord:
    """Every call of one op with one message size: latencies in ms, bandwidths in Gbps."""

    latencies_ms: list[float] = field(default_factory=list)
    algbw_gbps: list[float] = field(default_factory=list)
    busbw_gbps: list[float] = field(default_factory=list)


class CommsLogger:
    """What `configure` switched on, and the records: `records[op_name][message_bytes] -> OpRecord`."""

    def __init__(self, *, prof_all: bool = True, prof_ops=(), verbose: bool = False, debug: bool = False):
        self.prof_all, self.prof_ops = prof_all, list(prof_ops)
        self.verbose, self.debug = verbose, debug
        self.records: dict[str, dict[int, OpRecord]] = defaultdict(lambda: defaultdict(OpRecord))
        self.locality: dict[str, int] = defaultdict(int)  # "intra_node" / "inter_node" -> bytes
        self._scopes: dict = {}  # group -> its locality, worked out once per group

    def wants(self, name: str, prof: bool) -> bool:
        return self.prof_all or prof or name in self.prof_ops

    def timed(self, name: str, nbytes: int, run, *, group=None, prof: bool = False, log_name=None):
        """Run the collective `run()` and record it (when `name` is profiled)."""
        if not self.wants(name, prof):
            return run()
        device = _current_device()
        accelerator.synchronize(device)
        started = time.perf_counter()
        work = run()
        if work is not None and hasattr(work, "wait"):
            work.wait()
        accelerator.synchronize(device)
        self.record(log_name or name, name, nbytes, 1000 * (time.perf_counter() - started), group)
        return work

    def record(self, log_name: str, op: str, nbytes: int, latency_ms: float, group=None) -> None:
        if self.debug:
            log_name = f"{log_name} | [Caller Func: {_caller()}]"
        n = dist.get_world_size(group) if dist.is_initialized() else 1
        algbw = nbytes * 8 / (latency_ms * 1e6) if latency_ms > 0 else 0.0  # bytes/ms -> Gbps
        busbw = algbw * _BUS_FACTOR.get(op, lambda n: 1.0)(n)
        entry = self.records[log_name][nbytes]
        scope = self._scope(group)
        if scope is not None:
            self.locality[scope] += nbytes
        entry.latencies_ms.append(latency_ms)
        entry.algbw_gbps.append(algbw)
        entry.busbw_gbps.append(busbw)
        if self.verbose:
            log_dist(
                f"comm op: {log_name} | time (ms): {latency_ms:.2f} | msg size: {_size(nbytes)} | "
                f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}",
                ranks=None,
            )

    def bytes_by_op(self) -> dict[str, int]:
        """Total message bytes per op name (calls x size) since configure or the last `reset()`."""
        return {op: sum(size * len(r.latencies_ms) for size, r in by_size.items())
                for op, by_size in self.records.items()}  # fmt: skip

    def bytes_by_locality(self) -> dict[str, int]:
        """Total message bytes of collectives within one node (`intra_node`) and across nodes (`inter_node`)
        since configure or the last `reset()`."""
        return {"intra_node": self.locality["intra_node"], "inter_node": self.locality["inter_node"]}

    def _scope(self, group) -> str | None:
        """`intra_node` when every rank of `group` (None: the world) is on one node; None if unknown."""
        if not dist.is_initialized():
            return None
        key = group if group is not None else "world"
        if key not in self._scopes:
            try:
                layout = NodeLayout.from_env(dist.get_world_size())
            except ValueError:  # a malformed launcher variable: nothing to split by (ZeRO++ reports it)
                self._scopes[key] = None
            else:
                ranks = dist.get_process_group_ranks(group) if group is not None else range(layout.world_size)
                self._scopes[key] = "intra_node" if layout.within_one_node(ranks) else "inter_node"
        return self._scopes[key]

    def reset(self) -> None:
        self.records.clear()
        self.locality.clear()

    def summary(self, show_straggler: bool = False) -> str:
        header = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                  "tput_avg (Gbps)", "busbw_avg (Gbps)"]  # fmt: skip
        if show_straggler:
            header += ["Total comm. time (ms)", "Total straggler(ms)", "Avg straggler(ms)"]
        stragglers = self._stragglers() if show_straggler else {}
        lines = ["".join(f"{h:<20}" for h in header)]
        for op in sorted(self.records):
            lines.append(op)
            for size in sorted(self.records[op]):
                r = self.records[op][size]
                count, total = len(r.latencies_ms), sum(r.latencies_ms)
                cells = ["", _size(size), str(count), f"{total:.2f}", f"{total / count:.2f}",
                         f"{sum(r.algbw_gbps) / count:.2f}", f"{sum(r.busbw_gbps) / count:.2f}"]  # fmt: skip
                if show_straggler:
                    fastest = stragglers[(op, size)]
                    cells += [f"{total:.2f}", f"{total - fastest:.2f}", f"{(total - fastest) / count:.2f}"]
                lines.append("".join(f"{c:<20}" for c in cells))
        return "\n".join(lines)

    # -- DeepSpeed's CommsLogger methods, over the same records ------------------------------------------------
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in set(op_name_list)]

    @property
    def comms_dict(self) -> dict:
        """The records in DeepSpeed's layout, `{op: {size: [count, latencies, algbws, busbws]}}`; the lists
        are the recorded ones (not copies). Assigning one replaces the records."""
        return {op: {size: [len(r.latencies_ms), r.latencies_ms, r.algbw_gbps, r.busbw_gbps]
                     for size, r in by_size.items()} for op, by_size in self.records.items()}  # fmt: skip

    @comms_dict.setter
    def comms_dict(self, value: dict) -> None:
        self.records.clear()
        for op, by_size in value.items():
            for size, (_count, latencies, algbws, busbws) in by_size.items():
                self.records[op][size] = OpRecord(list(latencies), list(algbws), list(busbws))

    def get_raw_data(self) -> dict:
        return self.comms_dict

    def has_data(self) -> bool:
        return bool(self.records)

    def reset_data(self) -> None:
        self.reset()

    def get_operation_names(self) -> list[str]:
        return list(self.records)

    def get_total_operations(self) -> int:
        return sum(len(r.latencies_ms) for by_size in self.records.values() for r in by_size.values())

    def get_operation_summary(self, operation_name: str) -> dict | None:
        """Per message size of one op: count, total and trimmed-mean latency (ms), bandwidths (Gbps); None if
        the op was never recorded. The records are left as they are."""
        if operation_name not in self.records:
            return None
        return {
            size: {"count": len(r.latencies_ms), "total_latency_ms": sum(r.latencies_ms),
                   "avg_latency_ms": trim_mean(r.latencies_ms, 0.1), "tput_avg_gbps": trim_mean(r.algbw_gbps, 0.1),
                   "busbw_avg_gbps": trim_mean(r.busbw_gbps, 0.1), "msg_size_bytes": size, "msg_size_str": _size(size)}
            for size, r in self.records[operation_name].items()
        }  # fmt: skip

    def _stragglers(self) -> dict[tuple[str, int], float]:
        """The fastest rank's total latency per (op, size): the rest of ours was spent waiting for others.
        Every rank must call this (one all-reduce), with the same ops recorded."""
        keys = [(op, size) for op in sorted(self.records) for size in sorted(self.records[op])]
        totals = torch.tensor(
            [sum(self.records[op][size].latencies_ms) for op, size in keys], dtype=torch.float64
        )
        if dist.is_initialized() and keys:
            totals = totals.to(_current_device())
            dist.all_reduce(totals, op=dist.ReduceOp.MIN)
        return dict(zip(keys, totals.cpu().tolist()))


_active: CommsLogger | None = None


def active() -> CommsLogger | None:
    """The logger when on, else None (the one check a collective makes)."""
    return _active


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """Switch the logger on or off from a config's `comms_logger` block, explicit arguments overriding it."""
    global _active
    block = getattr(deepspeed_config, "comms_logger", None)
    if block is None and isinstance(deepspeed_config, dict):
        from shardspeed.config.build import BuildContext, build_block
        from shardspeed.config.monitoring import CommsLoggerConfig

        raw = deepspeed_config.get("comms_logger", {})
        block = build_block(CommsLoggerConfig, raw, "comms_logger", BuildContext())
    values = {
        "enabled": getattr(block, "enabled", False),
        "prof_all": getattr(block, "prof_all", True),
        "prof_ops": getattr(block, "prof_ops", []),
        "verbose": getattr(block, "verbose", False),
        "debug": getattr(block, "debug", False),
    }
    given = {
        "enabled": enabled,
        "prof_all": prof_all,
        "prof_ops": prof_ops,
        "verbose": verbose,
        "debug": debug,
    }
    values.update({k: v for k, v in given.items() if v is not None})
    enabled = values.pop("enabled")
    _active = CommsLogger(**values) if enabled else None


def log_summary(show_straggler: bool = False) -> str:
    """Print (on rank 0) and return the table of every recorded op. With `show_straggler`, a collective call
    every rank must make."""
    if _active is None:
        return ""
    text = _active.summary(show_straggler)
    log_dist("Comms summary\n" + text)
    return text


def trim_mean(data, trim_percent: float) -> float:
    """Mean of `data` without the `trim_percent` smallest and largest values (DeepSpeed's `utils.timer
    .trim_mean`); `data` is not reordered."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_mean: trim_percent must be in [0, 1], got {trim_percent}")
    ordered = sorted(data)
    if not ordered:
        return 0
    k = round(len(ordered) * trim_percent)
    kept = ordered[k : len(ordered) - k]
    return sum(kept) / len(kept)


def _current_device() -> torch.device:
    import os

    return accelerator.device_for_local_rank(int(os.environ.get("LOCAL_RANK", "0")))


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    return f"{nbytes} B"


def _caller() -> str:
    """The first function outside shardspeed.comm and torch that led to this op."""
    for frame in inspect.stack()[3:]:
        module = frame.frame.f_globals.get("__name__", "")
        if not module.startswith(("shardspeed.comm", "torch")):
            return frame.function
    return "?"
