"""Where DeepSpeed 0.19 puts each parameter's elements in its per-rank ZeRO files (learnt from its
stage_1_and_2.py, stage3.py and utils/zero_to_fp32.py; written here from that description).

ZeRO-1/2 (`Zero12Layout`): each optimizer parameter group is one flat buffer: the group's trainable
parameters in order, each followed by its `param_alignment_paddings` zeros (all 0 unless
`zero_optimization.parameter_alignment`), the whole padded at its end to a multiple of `2 * world` elements.
Rank r owns elements `[r * P, (r + 1) * P)`, P = padded size / world, and saves its fp32 master slice
(`single_partition_of_fp32_groups[g]`, the last rank's without the end padding) and its slice of each
per-element optimizer state (padding included) under the base optimizer's state index g.

ZeRO-3 (`Zero3Layout`): every parameter is partitioned on its own: rank r owns elements
`[r * c, (r + 1) * c)` of it, c = ceil(numel / world) (the last rank's piece zero-padded to c). A rank's flat
buffer of sub-group s (`fp32_flat_groups[s]`, and optimizer state index s) is the concatenation of its pieces of
the sub-group's parameters, in the order `param_shapes[s]` lists them.

Both answer one question: which (rank, flat buffer, start, length) pieces hold elements [lo, hi) of a
parameter (`pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.checkpoint.named_values import numel

__all__ = ["Piece", "Zero3Layout", "Zero12Layout"]

# DeepSpeed aligns each ZeRO-1/2 group to this many elements per rank (4 bytes of a 16-bit element: NCCL's
# start alignment), whatever the dtype.
_ALIGNMENT_PER_RANK = 2


@dataclass(frozen=True)
class Piece:
    """Elements `[start, start + length)` of `rank`'s flat buffer `buffer` (a group or sub-group index)."""

    rank: int
    buffer: int
    start: int
    length: int


@dataclass(frozen=True)
class _Place:
    buffer: int
    offset: int  # ZeRO-1/2: in the group's whole flat buffer; ZeRO-3: in each rank's flat buffer
    numel: int


class Zero12Layout:
    """ZeRO-1/2: `groups` lists each group's (name, shape) in flat order, `paddings` the zeros after each."""

    def __init__(self, groups: list[list[tuple[str, tuple]]], paddings: list[list[int]], world: int):
        self.world = world
        self.places: dict[str, _Place] = {}
        self.partition_numel: list[int] = []
        self.group_numel: list[int] = []  # unpadded end of the last parameter
        for g, params in enumerate(groups):
            offset = 0
            for i, (name, shape) in enumerate(params):
                self.places[name] = _Place(g, offset, numel(shape))
                offset += numel(shape) + (paddings[g][i] if paddings and paddings[g] else 0)
            align = _ALIGNMENT_PER_RANK * world
            self.group_numel.append(offset)
            self.partition_numel.append(-(-offset // align) * align // world)

    def group_of(self, name: str) -> int:
        return self.places[name].buffer

    def pieces(self, name: str, lo: int, hi: int) -> list[Piece]:
        place = self.places[name]
        size = self.partition_numel[place.buffer]
        start, end = place.offset + lo, place.offset + hi
        out = []
        for rank in range(start // size, -(-end // size)) if end > start else ():
            a, z = max(start, rank * size), min(end, (rank + 1) * size)
            out.append(Piece(rank, place.buffer, a - rank * size, z - a))
        return out

    def held_by(self, name: str, rank: int) -> list[tuple[int, int, int]]:
        """[(lo, hi, at)]: elements [lo, hi) of `name` that `rank` holds, at `at` in its flat buffer."""
        place, size = self.places[name], self.partition_numel[self.places[name].buffer]
        return [(p.rank * size + p.start - place.offset, p.rank * size + p.start - place.offset + p.length, p.start)
                for p in self.pieces(name, 0, place.numel) if p.rank == rank]  # fmt: skip

    def expected_fp32_numel(self, rank: int, group: int) -> int:
        """How many fp32 elements rank `rank` saves of group `group` (its slice without end padding)."""
        size = self.partition_numel[group]
        return max(0, min(size, self.group_numel[group] - rank * size))


class Zero3Layout:
    """ZeRO-3: `subgroups` lists each sub-group's (name, shape) in flat order."""

    def __init__(self, subgroups: list[list[tuple[str, tuple]]], world: int):
        self.world = world
        self.places: dict[str, _Place] = {}
        self.buffer_numel: list[int] = []  # each rank's flat buffer of each sub-group
        for s, params in enumerate(subgroups):
            offset = 0
            for name, shape in params:
                self.places[name] = _Place(s, offset, numel(shape))
                offset += self.chunk(numel(shape))
            self.buffer_numel.append(offset)

    def chunk(self, n: int) -> int:
        return -(-n // self.world)

    def group_of(self, name: str) -> int:
        return self.places[name].buffer

    def pieces(self, name: str, lo: int, hi: int) -> list[Piece]:
        place = self.places[name]
        c = self.chunk(place.numel)
        out = []
        for rank in range(lo // c, -(-hi // c)) if hi > lo else ():
            a, z = max(lo, rank * c), min(hi, (rank + 1) * c)
            out.append(Piece(rank, place.buffer, place.offset + a - rank * c, z - a))
        return out

    def held_by(self, name: str, rank: int) -> list[tuple[int, int, int]]:
        """[(lo, hi, at)]: elements [lo, hi) of `name` that `rank` holds, at `at` in its flat buffer."""
        place = self.places[name]
        c = self.chunk(place.numel)
        lo, hi = min(rank * c, place.numel), min((rank + 1) * c, place.numel)
        return [(lo, hi, place.offset)] if hi > lo else []
