"""The process topology: one rank grid over every parallel axis, and the process groups cut from it.

`ProcessTopology(axes, dims)` is pure arithmetic (no process groups): ranks are laid out row-major over the
axes, the last axis varying fastest, as DeepSpeed's topology does, so `PipeDataParallelTopology(2, 2)` puts
ranks 0,1 on stage 0 and 2,3 on stage 1. `ParallelGrid(topology)` creates, collectively, one process group
per slice of every axis (the ranks that differ only in that axis's coordinate) and answers the questions the
engine, the pipeline and a Megatron-style `mpu` ask: "my stage", "my data-parallel group", and so on.

Groups are created once, in a fixed order (axes in declaration order, slices in rank order), on every rank:
`torch.distributed.new_group` is collective over the whole world, so every rank must call it for every
slice in the same sequence, including slices it is not a member of. Nothing here is a module global; the
engine and the parallel parts are handed the grid.

Nodes: `NodeGroups` cuts ZeRO++'s groups out of each data-parallel group along the nodes `NodeLayout`
(comm/nodes.py) describes: the ranks of one node, the ranks with one local index across nodes, and hpZ's
secondary partition groups.
"""

from __future__ import annotations

import collections
import itertools
import math

import torch
import torch.distributed as dist

from shardspeed.comm.nodes import RANKS_PER_NODE_ENV, NodeLayout

__all__ = [
    "KNOWN_AXES",
    "NodeGroups",
    "ParallelGrid",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
]

# Axis names the rest of the library understands. "model" is tensor parallelism (Megatron's name, kept by
# DeepSpeed); "expert" and "sequence" are reserved for expert and sequence parallelism.
KNOWN_AXES = ("pipe", "data", "model", "expert", "sequence")


def _coord_class(axes: list[str]) -> type:
    """A named tuple of the axes that also reads as a mapping {axis: index} (for `**coord`, `coord[axis]`)."""

    class ProcessCoord(collections.namedtuple("ProcessCoord", axes)):
        __slots__ = ()

        def __getitem__(self, key):
            return getattr(self, key) if isinstance(key, str) else super().__getitem__(key)

        def keys(self):
            return self._fields

        def get(self, key: str, default=None):
            return getattr(self, key, default)

    return ProcessCoord


class ProcessTopology:
    """A Cartesian grid of ranks: `axes` names, `dims` degrees; rank = row-major index (last axis fastest)."""

    def __init__(self, axes: list[str], dims: list[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be distinct, got {axes}")
        bad = [f"{a}={d}" for a, d in zip(axes, dims) if d < 1]
        if bad:
            raise ValueError(f"ProcessTopology: every degree must be >= 1, got {', '.join(bad)}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = _coord_class(axes)  # DeepSpeed's name for the coordinate type of this grid
        # strides[i]: how far apart in rank two neighbours along axis i are
        self._strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Degree of `axis`; 0 when the topology has no such axis (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coords: int) -> int:
        """The rank at the given coordinates; every axis must be given."""
        if set(coords) != set(self.axes):
            raise ValueError(f"get_rank needs exactly the axes {self.axes}, got {sorted(coords)}")
        rank = 0
        for axis, dim, stride in zip(self.axes, self.dims, self._strides):
            c = coords[axis]
            if not 0 <= c < dim:
                raise ValueError(f"coordinate {axis}={c} is outside 0..{dim - 1}")
            rank += c * stride
        return rank

    def get_coord(self, rank: int):
        """Coordinates of `rank`: `coord.pipe`, as DeepSpeed's named tuple, and `coord["pipe"]` / `**coord`."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} is outside the topology's world of {self.world_size()}")
        return self.ProcessCoord(*((rank // stride) % dim for dim, stride in zip(self.dims, self._strides)))

    def get_rank_repr(
        self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"
    ):
        """E.g. "model_01" for checkpoint file names; the omitted axes are left out."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{coord[axis]:02d}" for axis in self.axes if axis not in omit_axes
        )

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Every slice along `axis`: the rank lists that differ only in `axis`, ordered by their first rank."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            coords = dict(zip(others, fixed))
            lists.append([self.get_rank(**coords, **{axis: i}) for i in range(self.get_dim(axis))])
        return sorted(lists)

    def filter_match(self, **filters: int) -> list[int]:
        """Ranks whose coordinates match every given {axis: index}."""
        return [
            r for r in range(self.world_size()) if all(self.get_coord(r)[a] == i for a, i in filters.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate along `axis` is `idx`."""
        return self.filter_match(**{axis: idx}) if axis in self.axes else []

    def __str__(self) -> str:
        return "ProcessTopology(" + ", ".join(f"{a}={d}" for a, d in zip(self.axes, self.dims)) + ")"

    __repr__ = __str__


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel replicas (data varies fastest: a stage's replicas are neighbours)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """3D: pipeline x data x tensor ("model") parallelism; tensor-parallel peers are neighbours."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class ParallelGrid:
    """Process groups for every axis of `topology`, and this rank's place in them.

    Collective: every rank of the world must construct it, in the same order relative to other group
    creation. Also the Megatron `mpu` protocol (`get_data_parallel_group`, `get_model_parallel_rank`, ...),
    so the engine can take it wherever it takes an `mpu`.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group=None):
        del process_group  # DeepSpeed's argument; groups are always cut from the world
        world = dist.get_world_size()
        if topology is None:
            topology = PipeDataParallelTopology(1, world)
        if topology.world_size() != world:
            degrees = " x ".join(f"{a}={d}" for a, d in zip(topology.axes, topology.dims))
            raise ValueError(
                f"topology degrees {degrees} = {topology.world_size()} ranks do not match the world size {world}"
            )
        self._topo = topology
        self.global_rank = dist.get_rank()
        self.world_size = world
        self._coord = topology.get_coord(self.global_rank)
        self._groups: dict[str, object] = {}
        self._group_ranks: dict[str, list[int]] = {}
        for axis in topology.axes:  # fixed order on every rank: axes as declared, slices by first rank
            for ranks in topology.get_axis_comm_lists(axis):
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    self._groups[axis], self._group_ranks[axis] = group, ranks
        # DeepSpeed's "model parallel" group is every rank of one data-parallel replica (pipe x tensor): the
        # ranks that together hold one copy of the model, over which norms and overflow flags are combined.
        for ranks in self._replica_rank_lists():
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                self._groups["replica"], self._group_ranks["replica"] = group, ranks
        # Ulysses: parameters are replicated over the sequence ranks as over the data ranks, so gradients are
        # averaged (and ZeRO shards) over both together: DeepSpeed's "sequence-data-parallel" group.
        if "sequence" in topology.axes:
            for ranks in self._sequence_data_rank_lists():
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    self._groups["sequence_data"], self._group_ranks["sequence_data"] = group, ranks

    def _replica_rank_lists(self) -> list[list[int]]:
        """One model replica: the ranks that share a data and a sequence coordinate (pipe x tensor)."""
        return self._slices_varying(lambda axis: axis not in ("data", "sequence"))

    def _sequence_data_rank_lists(self) -> list[list[int]]:
        """The ranks that share every coordinate but data and sequence."""
        return self._slices_varying(lambda axis: axis in ("data", "sequence"))

    def _slices_varying(self, varies) -> list[list[int]]:
        """Rank lists, one per fixed value of the axes for which `varies(axis)` is false, in rank order."""
        fixed = [a for a in self._topo.axes if not varies(a)]
        slices: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            coord = self._topo.get_coord(rank)
            slices.setdefault(tuple(coord[a] for a in fixed), []).append(rank)
        return sorted(slices.values())

    # -- the topology and this rank's coordinates ------------------------------------------------------------

    @property
    def topology(self) -> ProcessTopology:
        return self._topo

    def _axis_rank(self, axis: str) -> int:
        return self._coord.get(axis, 0)

    def _axis_size(self, axis: str) -> int:
        return max(1, self._topo.get_dim(axis))

    def _axis_group(self, axis: str):
        if axis not in self._groups:
            raise ValueError(f"the topology {self._topo} has no {axis!r} axis, so it has no {axis} group")
        return self._groups[axis]

    def get_global_rank(self) -> int:
        return self.global_rank

    def axis_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's slice along `axis` (itself alone when the axis is absent)."""
        return list(self._group_ranks.get(axis, [self.global_rank]))

    # -- pipeline ---------------------------------------------------------------------------------------------

    def get_stage_id(self) -> int:
        return self._axis_rank("pipe")

    def get_pipe_parallel_rank(self) -> int:
        return self._axis_rank("pipe")

    def get_pipe_parallel_world_size(self) -> int:
        return self._axis_size("pipe")

    def get_pipe_parallel_group(self):
        return self._axis_group("pipe")

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def is_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    def is_last_stage(self) -> bool:
        return self.get_stage_id() == self.get_pipe_parallel_world_size() - 1

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """Global rank of `stage_id` at this rank's other coordinates (overridden by `coords`)."""
        target = dict(self._coord, pipe=stage_id, **coords)
        return self._topo.get_rank(**target)

    # -- data -------------------------------------------------------------------------------------------------

    def get_data_parallel_id(self) -> int:
        return self._axis_rank("data")

    def get_data_parallel_rank(self) -> int:
        return self._axis_rank("data")

    def get_data_parallel_world_size(self) -> int:
        return self._axis_size("data")

    def get_data_parallel_group(self):
        return self._axis_group("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.axis_ranks("data")

    # -- tensor ("slice") parallelism, and DeepSpeed's model-parallel group (one whole replica) ---------------

    def get_slice_parallel_rank(self) -> int:
        return self._axis_rank("model")

    def get_slice_parallel_world_size(self) -> int:
        return self._axis_size("model")

    def get_slice_parallel_group(self):
        return self._axis_group("model")

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group

    def get_model_parallel_rank(self) -> int:
        """Rank within this data-parallel replica (pipe x tensor), as DeepSpeed's grid and Megatron's mpu."""
        return self._group_ranks["replica"].index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self._group_ranks["replica"])

    def get_model_parallel_group(self):
        return self._groups["replica"]

    # -- sequence (Ulysses) parallelism ------------------------------------------------------------------------

    def get_sequence_parallel_rank(self) -> int:
        return self._axis_rank("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return self._axis_size("sequence")

    def get_sequence_parallel_group(self):
        return self._axis_group("sequence")

    def get_sequence_data_parallel_group(self):
        """Data x sequence ranks (gradient averaging, ZeRO sharding); the data group without a sequence axis."""
        return (
            self._groups["sequence_data"]
            if "sequence_data" in self._groups
            else self.get_data_parallel_group()
        )

    def get_sequence_data_parallel_world_size(self) -> int:
        return len(self._group_ranks.get("sequence_data", self.axis_ranks("data")))

    def get_sequence_data_parallel_rank(self) -> int:
        return self._group_ranks.get("sequence_data", self.axis_ranks("data")).index(self.global_rank)


PipelineParallelGrid = ParallelGrid  # DeepSpeed's name


class NodeGroups:
    """ZeRO++'s process groups inside this rank's data-parallel group, cut along nodes.

    - `intra_node`: the data-parallel ranks on this rank's node (`local_size` of them; qgZ's first all-to-all);
    - `inter_node`: the data-parallel ranks with this rank's local index, one per node (`num_nodes` of
      them; qgZ's second all-to-all);
    - `hpz`: `hpz_size` consecutive data-parallel ranks (hpZ's secondary partition group; the intra-node
      group itself when it has that size).

    Collective over the world: every rank builds it with the same arguments. The data-parallel groups of all
    ranks are exchanged first (one small all-gather), so every rank creates every group, in one order, and
    raises the same error when the layout does not fit. Errors are ValueErrors naming what does not fit;
    the caller adds the config key.
    """

    def __init__(self, group, layout: NodeLayout, *, hpz_size: int = 1, hierarchical: bool = False):
        slices, nodes = _exchange_layout(group, layout)
        rank = dist.get_rank()
        mine = next(s for s in slices if rank in s)
        _check_nodes(nodes, layout)
        per_node = _per_node(mine, layout)
        self.local_size = len(per_node[0])
        self.num_nodes = len(per_node)
        self.hpz_size = hpz_size
        self.intra_node = self.inter_node = self.hpz = None
        for ranks in slices:
            self._create(ranks, layout, hpz_size, hierarchical, mine=ranks == mine)
        self.hpz_spans_nodes = hpz_size > 1 and not layout.within_one_node(mine[:hpz_size])

    def _create(self, ranks: list[int], layout: NodeLayout, hpz_size: int, hierarchical: bool, mine: bool):
        rank = dist.get_rank()
        per_node = _per_node(ranks, layout)
        intra: dict[tuple, object] = {}
        if hierarchical:
            if len({len(n) for n in per_node}) != 1:
                counts = ", ".join(f"{len(n)}" for n in per_node)
                raise ValueError(
                    f"the data-parallel group {ranks} has {counts} ranks on its nodes; a hierarchical "
                    "reduction needs the same number of data-parallel ranks on every node"
                )
            for members in per_node:
                intra[tuple(members)] = _new_group(members, rank, mine, self, "intra_node")
            for local in range(len(per_node[0])):
                _new_group([members[local] for members in per_node], rank, mine, self, "inter_node")
        if hpz_size > 1:
            if len(ranks) % hpz_size:
                raise ValueError(
                    f"a secondary partition of {hpz_size} ranks does not divide the data-parallel group of "
                    f"{len(ranks)} ranks {ranks}"
                )
            for start in range(0, len(ranks), hpz_size):
                members = ranks[start : start + hpz_size]
                reused = intra.get(tuple(members))
                if reused is not None:  # the node's group: no second communicator for the same ranks
                    if rank in members:
                        self.hpz = reused
                else:
                    _new_group(members, rank, mine, self, "hpz")


def _new_group(members: list[int], rank: int, mine: bool, owner: NodeGroups, attribute: str):
    group = dist.new_group(ranks=members)  # collective over the world: every rank creates every group
    if mine and rank in members:
        setattr(owner, attribute, group)
    return group


def _per_node(ranks: list[int], layout: NodeLayout) -> list[list[int]]:
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(layout.node_of(r), []).append(r)
    return [nodes[n] for n in sorted(nodes)]


def _exchange_layout(group, layout: NodeLayout) -> tuple[list[list[int]], list[int]]:
    """Every rank's data-parallel group and launcher-stated node (-1: none): one all-gather over the world."""
    from shardspeed.comm.collectives import comm_device

    world = dist.get_world_size()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    row = torch.full((world + 1,), -1, dtype=torch.int64, device=comm_device())
    row[: len(ranks)] = torch.tensor(sorted(ranks), dtype=torch.int64)
    row[world] = -1 if layout.node_hint is None else layout.node_hint
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    table = torch.stack(rows).cpu().tolist()
    slices = sorted({tuple(r for r in t[:world] if r >= 0) for t in table})
    return [list(s) for s in slices], [t[world] for t in table]


def _check_nodes(nodes: list[int], layout: NodeLayout) -> None:
    """The launcher's node indices (where stated) must be the layout's, or intra/inter would be mislabelled."""
    for rank, node in enumerate(nodes):
        if node >= 0 and node != layout.node_of(rank):
            raise ValueError(
                f"rank {rank} runs on node {node} but {layout.source}={layout.ranks_per_node} puts it on node "
                f"{layout.node_of(rank)}: nodes must hold equal numbers of consecutive ranks (set "
                f"{RANKS_PER_NODE_ENV} to describe the layout)"
            )
