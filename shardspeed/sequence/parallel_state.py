"""DeepSpeed's `runtime.sequence_parallel.parallel_state_sp`: the sequence-parallel groups ALST trains with.

ALST (Arctic Long Sequence Training) hands this module itself to `deepspeed.initialize(mpu=...)` and to
Accelerate as its "mpu": `initialize_sequence_parallel(sp)` cuts the world into sequence groups of `sp`
consecutive ranks (world 4, sp 2: [0, 1] and [2, 3]) and one sequence-data group (every rank holding the
same parameters, over which gradients are averaged and ZeRO shards); the getters answer from them.

The groups are those of a `ParallelGrid` over axes (data, sequence) — the same grid `sequence_parallel_size`
builds in core/layout.py, so both routes give the engine the same layout. DeepSpeed's module keeps two
module globals; here one grid is kept (DeepSpeed's API is module functions, so the state cannot be handed
around instead). `get_model_parallel_*` are the sequence getters, as in DeepSpeed ("since we only have one
dimension over data parallelism"). `get_data_parallel_*` are extensions DeepSpeed's module lacks (its engine
then divides the world by the sequence degree); shardspeed's `initialize` asks an mpu for them.
"""

from __future__ import annotations

import torch.distributed as dist

from shardspeed.comm.topology import ParallelGrid, ProcessTopology

__all__ = [
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]

# the grid, and the world group it was cut from: DeepSpeed releases these groups when the world group is torn
# down, so a grid whose world is gone counts as never built (a new job in the process may initialize again)
_STATE: dict[str, object] = {"grid": None, "world": None}


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence and sequence-data groups (collective: every rank calls it, once per process)."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: torch.distributed is not initialized")
    world = dist.get_world_size()
    if world < sequence_parallel_size:
        raise RuntimeError(
            f"world_size ({world}) is less than sequence_parallel_size {sequence_parallel_size}"
        )
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size != 0:
        raise RuntimeError(
            f"world_size ({world}) is not divisible by sequence_parallel_size {sequence_parallel_size}"
        )
    if _live_grid() is not None:
        raise RuntimeError("sequence parallel group is already initialized")
    topology = ProcessTopology(
        ["data", "sequence"], [world // sequence_parallel_size, sequence_parallel_size]
    )
    _STATE["grid"], _STATE["world"] = ParallelGrid(topology), dist.group.WORLD


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (DeepSpeed calls this at teardown; the next initialize may build new ones)."""
    _STATE["grid"] = _STATE["world"] = None


def _live_grid() -> ParallelGrid | None:
    if _STATE["grid"] is not None and (not dist.is_initialized() or _STATE["world"] is not dist.group.WORLD):
        _release_sequence_parallel_groups()  # its world group was destroyed
    return _STATE["grid"]


def _grid() -> ParallelGrid:
    grid = _live_grid()
    if grid is None:
        raise RuntimeError(
            "sequence parallel group is not initialized: call initialize_sequence_parallel(sequence_parallel_size)"
        )
    return grid


def get_sequence_parallel_group():
    return _grid().get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return _grid().get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return _grid().get_sequence_parallel_rank()


def get_sequence_data_parallel_group():
    return _grid().get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    return _grid().get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    return _grid().get_sequence_data_parallel_rank()


def get_data_parallel_group():
    return _grid().get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    return _grid().get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    return _grid().get_data_parallel_rank()


# DeepSpeed: "since we only have 1 additional dimension over DP, we can just alias MP with SP"
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
