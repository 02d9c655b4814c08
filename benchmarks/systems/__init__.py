"""The systems the harness can run, by row name, in the order the table lists them."""

from __future__ import annotations

import os

from benchmarks.systems import deepspeed_engine, fsdp2, one_process, shardspeed_engine, torch_ddp
from benchmarks.systems.base import BuildContext, System, SystemUnavailable, Trainer

__all__ = [
    "BASELINE_TREE_ENV",
    "SYSTEMS",
    "BuildContext",
    "System",
    "SystemUnavailable",
    "Trainer",
    "resolve",
]

_WORLD = 2
# The checkout of shardspeed the `baseline-z*` rows import (set by run.py's --baseline-tree); their ranks
# put it first on sys.path (worker._child), so a before/after comparison runs interleaved in one suite.
BASELINE_TREE_ENV = "SHARDSPEED_BENCH_BASELINE_TREE"
_USES_BASELINE = (("SHARDSPEED_BENCH_USE_BASELINE", "1"),)


def _baseline_unavailable() -> str | None:
    return None if os.environ.get(BASELINE_TREE_ENV) else "no --baseline-tree given"


def _registry() -> dict[str, System]:
    rows = [System("one-process", "one-process", 0, 1, one_process.build)]
    # Two ranks each training alone (no collective): what sharing the cores costs before any communication.
    rows.append(System("no-comm-x2", "one-process", 0, _WORLD, one_process.build))
    rows += [System(f"shardspeed-z{s}", "shardspeed", s, _WORLD, shardspeed_engine.build) for s in range(4)]
    rows.append(System("shardspeed-offload", "shardspeed", 2, _WORLD, shardspeed_engine.build_offload))
    rows += [
        System(f"baseline-z{s}", "baseline", s, _WORLD, shardspeed_engine.build, _USES_BASELINE,
               _baseline_unavailable)
        for s in range(4)
    ]  # fmt: skip
    rows.append(System("ddp", "torch", 0, _WORLD, torch_ddp.build_ddp))
    rows.append(System("zero-redundancy", "torch", 1, _WORLD, torch_ddp.build_zero_redundancy))
    rows.append(System("fsdp2", "torch", 3, _WORLD, fsdp2.build))
    rows += [
        System(f"deepspeed-z{s}", "deepspeed", s, _WORLD, deepspeed_engine.build, deepspeed_engine.ENV,
               deepspeed_engine.unavailable)
        for s in range(4)
    ]  # fmt: skip
    return {row.name: row for row in rows}


SYSTEMS: dict[str, System] = _registry()


def resolve(names: list[str]) -> list[System]:
    """Row names (or groups: "all", "shardspeed", "torch", "deepspeed", "baseline") to systems, in table order.
    "all" leaves out the baseline rows, which need --baseline-tree."""
    wanted: list[str] = []
    for name in names:
        if name == "all":
            wanted += [n for n, s in SYSTEMS.items() if s.family != "baseline"]
        elif name in SYSTEMS:  # a row name wins over a family of the same name ("one-process")
            wanted.append(name)
        elif name in {s.family for s in SYSTEMS.values()}:
            wanted += [n for n, s in SYSTEMS.items() if s.family == name]
        else:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)} or a group")
    return [SYSTEMS[n] for n in SYSTEMS if n in wanted]
