"""The collectives of the `deepspeed.comm` facade: torch.distributed's own, seen by the comms logger.

Each takes torch's arguments plus DeepSpeed's logging keywords (`prof`, `log_name`, `debug`). With the
logger off a call is forwarded to torch unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from shardspeed.comm import logger

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


def _bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(t) for t in obj)
    return 0


def _logged(torch_fn, message_arg: int):
    """`torch_fn` with DeepSpeed's logging keywords; `message_arg` is the positional index of the argument
    whose bytes are the message size (-1: no message, e.g. barrier)."""
    name = torch_fn.__name__

    @functools.wraps(torch_fn)
    def op(*args, prof: bool = False, log_name: str | None = None, debug=None, **kwargs):
        log = logger.active()
        if log is None:
            return torch_fn(*args, **kwargs)
        nbytes = _bytes(args[message_arg]) if 0 <= message_arg < len(args) else 0
        run = functools.partial(torch_fn, *args, **kwargs)
        return log.timed(name, nbytes, run, group=kwargs.get("group"), prof=prof, log_name=log_name or name)

    return op


all_reduce = _logged(dist.all_reduce, 0)
broadcast = _logged(dist.broadcast, 0)
reduce = _logged(dist.reduce, 0)
all_gather = _logged(dist.all_gather, 0)  # the list of gathered tensors
all_gather_into_tensor = _logged(dist.all_gather_into_tensor, 0)  # the gathered output
reduce_scatter = _logged(dist.reduce_scatter, 1)  # the list of inputs
reduce_scatter_tensor = _logged(dist.reduce_scatter_tensor, 1)  # the full input
all_to_all_single = _logged(dist.all_to_all_single, 1)
all_to_all = _logged(dist.all_to_all, 1)
send = _logged(dist.send, 0)
recv = _logged(dist.recv, 0)
isend = _logged(dist.isend, 0)
irecv = _logged(dist.irecv, 0)
gather = _logged(dist.gather, 0)
scatter = _logged(dist.scatter, 0)
barrier = _logged(dist.barrier, -1)
