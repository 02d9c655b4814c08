"""`zero_optimization.pipeline_loading_checkpoint`: the ranks of one machine read their checkpoint partitions
one after another instead of all at once.

DeepSpeed's stage 3 takes this option to bound a node's host-memory peak and disk contention while every rank
loads its partition. The ranks of a machine are found by host name (one small all-gather, every rank of the
group); each waits for a token from the previous rank of its machine, reads, and passes the token on, also
when its read failed (the error is raised on that rank after the token is passed, so no neighbour waits
forever). Only the reading and copying runs in turns: what follows it that is collective (stage 3 re-gathers
its persistent units) runs on every rank together, after the turns.
"""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_strings

__all__ = ["node_turns"]


@contextlib.contextmanager
def node_turns(enabled: bool, device, group=None):
    """Run the block on this machine's ranks one at a time, in rank order (collective over `group` when
    enabled; a plain block when not, or in a one-rank group)."""
    if not enabled or dist.get_world_size(group) == 1:
        yield
        return
    hosts = all_gather_strings(socket.gethostname(), device, group)
    me = dist.get_rank(group)
    peers = [rank for rank, host in enumerate(hosts) if host == hosts[me]]
    position = peers.index(me)
    token = torch.zeros(1, device=device)

    def global_rank(rank: int) -> int:
        return dist.get_global_rank(group, rank) if group is not None else rank

    if position > 0:
        dist.recv(token, src=global_rank(peers[position - 1]), group=group)
    try:
        yield
    finally:
        if position + 1 < len(peers):
            dist.send(token, dst=global_rank(peers[position + 1]), group=group)
