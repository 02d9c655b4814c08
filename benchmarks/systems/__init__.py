"""The systems the harness can run, by row name, in the order the table lists them."""

from __future__ import annotations

from benchmarks.systems import deepspeed_engine, fsdp2, one_process, shardspeed_engine, torch_ddp
from benchmarks.systems.base import BuildContext, System, SystemUnavailable, Trainer

__all__ = ["SYSTEMS", "BuildContext", "System", "SystemUnavailable", "Trainer", "resolve"]

_WORLD = 2


def _registry() -> dict[str, System]:
    rows = [System("one-process", "one-process", 0, 1, one_process.build)]
    # Two ranks each training alone (no collective): what sharing the cores costs before any communication.
    rows.append(System("no-comm-x2", "one-process", 0, _WORLD, one_process.build))
    rows += [System(f"shardspeed-z{s}", "shardspeed", s, _WORLD, shardspeed_engine.build) for s in range(4)]
    rows.append(System("shardspeed-offload", "shardspeed", 2, _WORLD, shardspeed_engine.build_offload))
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
    """Row names (or groups: "all", "shardspeed", "torch", "deepspeed") to systems, in table order."""
    wanted: list[str] = []
    for name in names:
        if name == "all":
            wanted += list(SYSTEMS)
        elif name in SYSTEMS:  # a row name wins over a family of the same name ("one-process")
            wanted.append(name)
        elif name in {s.family for s in SYSTEMS.values()}:
            wanted += [n for n, s in SYSTEMS.items() if s.family == name]
        else:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)} or a group")
    return [SYSTEMS[n] for n in SYSTEMS if n in wanted]
