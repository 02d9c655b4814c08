"""Expert-parallel and expert-data-parallel process groups, cut from the data axis of the rank grid.

For expert-parallel size `ep`, every data-parallel slice `d_0 … d_{n-1}` (global ranks of one data group) is
cut as DeepSpeed cuts it: expert-parallel groups of `ep` consecutive data ranks `d[j·ep : (j+1)·ep]` (they
exchange tokens and together hold every expert), and expert-data-parallel groups `d[i::ep]` (the ranks that
hold the same experts and average their gradients). The group name is `"ep_size_<ep>"`.

`build_expert_groups` is collective (every rank creates every group, in one order). The engine calls it at
initialize for the ep sizes of the model's MoE layers and hands the groups to the layers; `latest()` is the
set the last call built, which the `deepspeed.utils.groups` accessors read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_strings, comm_device

__all__ = [
    "ExpertGroup",
    "ExpertGroups",
    "build_expert_groups",
    "build_expert_groups_from_tables",
    "data_parallel_slices",
    "expert_parallel_ranks",
    "latest",
]


@dataclass
class ExpertGroup:
    """This rank's two groups for one expert-parallel size."""

    name: str
    ep_size: int
    ep_group: object
    ep_ranks: list[int]
    edp_group: object
    edp_ranks: list[int]
    dp_world_size: int
    # Tensor lanes splitting one replica's tokens between them (AutoEP folded onto AutoTP, autoep/folding.py):
    # each lane's gradient reaches the experts `tp_lanes` times over (the restore gather sums the lanes).
    tp_lanes: int = 1

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(dist.get_rank())

    @property
    def edp_rank(self) -> int:
        return self.edp_ranks.index(dist.get_rank())

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)


@dataclass
class ExpertGroups:
    by_name: dict[str, ExpertGroup] = field(default_factory=dict)

    def __getitem__(self, name: str) -> ExpertGroup:
        if name not in self.by_name:
            raise KeyError(f"no expert group {name!r}; built: {sorted(self.by_name)}")
        return self.by_name[name]


_latest = ExpertGroups()


def latest() -> ExpertGroups:
    """The groups the last `build_expert_groups` built (empty before any)."""
    return _latest


def data_parallel_slices(mpu=None) -> list[list[int]]:
    """Every data-parallel group's global ranks, sorted: from the grid's topology, or the world."""
    if mpu is None:
        return [list(range(dist.get_world_size()))]
    topology = getattr(mpu, "topology", None)  # a ParallelGrid's property, a PipelineModule's method
    topology = topology() if callable(topology) else topology
    if topology is not None and hasattr(topology, "get_axis_comm_lists"):
        return topology.get_axis_comm_lists("data")
    # a foreign mpu: ask every rank for its data group (as text: torch's *_object collectives need NumPy)
    mine = json.dumps(dist.get_process_group_ranks(mpu.get_data_parallel_group()))
    gathered = [json.loads(text) for text in all_gather_strings(mine, comm_device())]
    return sorted({tuple(r) for r in gathered})


def build_expert_groups(ep_sizes, mpu=None) -> ExpertGroups:
    """Create (collectively) the groups of every ep size in `ep_sizes`; raise if one does not divide the
    data-parallel world."""
    global _latest
    slices = [list(s) for s in data_parallel_slices(mpu)]
    dp_world = len(slices[0])
    me = dist.get_rank()
    built = ExpertGroups(dict(_latest.by_name))
    for ep in sorted(set(int(e) for e in ep_sizes)):
        name = f"ep_size_{ep}"
        if ep < 1 or dp_world % ep != 0:
            raise ValueError(
                f"MoE ep_size={ep} must divide the data-parallel world size {dp_world} "
                f"(world size {dist.get_world_size()})"
            )
        ep_groups, edp_groups = _cut(slices, ep)
        if _still_valid(built.by_name.get(name), ep_groups):
            continue
        mine: dict = {}
        for ranks in ep_groups:
            _new_group(ranks, me, mine, "ep")
        for ranks in edp_groups:
            _new_group(ranks, me, mine, "edp")
        built.by_name[name] = ExpertGroup(name, ep, *mine["ep"], *mine["edp"], dp_world)
    _latest = built
    return built


def _still_valid(existing: ExpertGroup | None, ep_groups: list[list[int]]) -> bool:
    """Whether a group built earlier under this name is one of this cut on every rank (a group built for
    another layout, a folded one say, is rebuilt). Collective, so that every rank decides alike."""
    valid = existing is not None and existing.tp_lanes == 1 and existing.ep_ranks in ep_groups
    flag = torch.tensor([int(valid)], device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def build_expert_groups_from_tables(
    name: str, ep_size: int, ep_tables, edp_tables, *, dp_world_size: int, tp_lanes: int = 1
) -> ExpertGroups:
    """Create (collectively) the groups of one ep size from given rank tables (a folded layout's, where
    expert groups span tensor lanes) and register them under `name`, replacing a group of that name built
    for another layout."""
    global _latest
    mine: dict = {}
    for ranks in ep_tables:
        _new_group(list(ranks), dist.get_rank(), mine, "ep")
    for ranks in edp_tables:
        _new_group(list(ranks), dist.get_rank(), mine, "edp")
    built = ExpertGroups(dict(_latest.by_name))
    built.by_name[name] = ExpertGroup(name, ep_size, *mine["ep"], *mine["edp"], dp_world_size, tp_lanes)
    _latest = built
    return built


def _cut(slices: list[list[int]], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Expert-parallel groups (consecutive `ep` ranks of each data slice) and expert-data-parallel groups
    (every `ep`-th rank of each data slice)."""
    ep_groups = [ranks[j * ep : (j + 1) * ep] for ranks in slices for j in range(len(ranks) // ep)]
    edp_groups = [ranks[i::ep] for ranks in slices for i in range(ep)]
    return ep_groups, edp_groups


def expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel and expert-data-parallel rank lists of a layout, without creating groups.

    DeepSpeed's `utils.groups._get_expert_parallel_ranks`: ranks are pipeline-major with tensor ranks
    neighbours, so each data slice is one pipeline stage's ranks of one tensor position; the cut is the one
    `build_expert_groups` makes.
    """
    if use_data_before_expert_parallel_:
        raise ValueError(
            "use_data_before_expert_parallel_: not supported (expert ranks are cut data-slice first)"
        )
    stage = world_size // pipeline_parallel_size_
    if stage * pipeline_parallel_size_ != world_size or stage % tensor_parallel_size_:
        raise ValueError(
            f"world_size {world_size} is not a multiple of pipeline {pipeline_parallel_size_} x tensor "
            f"{tensor_parallel_size_}"
        )
    slices = [
        list(range(start + t, start + stage, tensor_parallel_size_))
        for start in range(0, world_size, stage)
        for t in range(tensor_parallel_size_)
    ]
    if len(slices[0]) % expert_parallel_size_:
        raise ValueError(
            f"expert_parallel_size_ {expert_parallel_size_} must divide the data-parallel size {len(slices[0])}"
        )
    return _cut(slices, expert_parallel_size_)


def _new_group(ranks: list[int], me: int, mine: dict, kind: str) -> None:
    group = dist.new_group(ranks)  # collective over the world, even for groups this rank is not in
    if me in ranks:
        mine[kind] = (group, list(ranks))
