"""Which node each rank runs on, from the launcher's environment (or an override that simulates nodes).

The comms logger uses it to count the bytes of collectives that stay inside a node apart from those that
cross nodes, and ZeRO++ (zero/zeropp/) to cut its intra- and inter-node groups (comm/topology.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RANKS_PER_NODE_ENV", "NodeLayout"]

RANKS_PER_NODE_ENV = "SHARDSPEED_RANKS_PER_NODE"
# Launchers' "ranks on this node": torchrun, the shardspeed launcher, OpenMPI, MPICH/Intel MPI.
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
# Launchers' "index of this node": torchrun, the shardspeed launcher, SLURM.
_NODE_RANK_VARS = ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID")


@dataclass(frozen=True)
class NodeLayout:
    """Which node each global rank runs on: nodes hold `ranks_per_node` consecutive ranks each, as every
    launcher lays them out (node 0 has ranks 0..k-1, node 1 the next k, ...).

    `ranks_per_node` comes from `SHARDSPEED_RANKS_PER_NODE` when set (to simulate several nodes on one
    machine: 4 ranks with `SHARDSPEED_RANKS_PER_NODE=2` are 2 nodes x 2), else from the launcher's
    ranks-on-this-node variable, else the job is one node. `node_hint` is this rank's node index as the
    launcher states it (None if it does not), which `NodeGroups` checks against the layout on every rank.
    """

    world_size: int
    ranks_per_node: int
    source: str  # the variable ranks_per_node came from
    node_hint: int | None = None

    @classmethod
    def from_env(cls, world_size: int, env: Mapping[str, str] | None = None) -> NodeLayout:
        env = os.environ if env is None else env
        name = next((n for n in (RANKS_PER_NODE_ENV, *_LOCAL_SIZE_VARS) if n in env), None)
        if name is None:
            return cls(world_size, world_size, "one node (no launcher variable)")
        try:
            per_node = int(env[name])
        except ValueError:
            raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None
        if per_node < 1 or world_size % per_node:
            raise ValueError(
                f"environment variable {name}={env[name]}: {world_size} ranks do not split into nodes of "
                f"{per_node} ranks (nodes must hold equal numbers of ranks)"
            )
        hint_name = (
            None if name == RANKS_PER_NODE_ENV else next((n for n in _NODE_RANK_VARS if n in env), None)
        )
        hint = int(env[hint_name]) if hint_name is not None and env[hint_name].isdigit() else None
        return cls(world_size, per_node, name, hint)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def within_one_node(self, ranks) -> bool:
        """True when every rank of `ranks` runs on the same node (a collective over them stays in it)."""
        return len({self.node_of(r) for r in ranks}) <= 1
