"""A rank that ends right after a burst of asynchronous Gloo collectives on Python-owned tensors.

That is the exit that aborted with torch 2.13 before the exit hook of `init_distributed` waited for
Gloo's worker threads ([Note: Gloo teardown abort]): 8 of 20 four-rank launches died with exit code 134
here without it. TEARDOWN_DESTROY=1 also destroys the process group in the script, as many scripts do.
"""

import os
import sys

import torch
import torch.distributed as dist

import shardspeed.comm

shardspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
flat = torch.zeros(4096)
for _ in range(3):
    parts = flat.split(512)
    works = [dist.broadcast(p, src=i % dist.get_world_size(), async_op=True) for i, p in enumerate(parts)]
    for work in works:
        work.wait()
    del works, parts
if os.environ.get("TEARDOWN_DESTROY") == "1":
    dist.destroy_process_group()
rank = dist.get_rank() if dist.is_initialized() else os.environ["RANK"]
# One write with its newline: ranks share the launcher's pipe, and print() under PYTHONUNBUFFERED writes the
# text and the newline separately, so lines of different ranks could run together.
sys.stdout.write(f"teardown rank {rank} done\n")
sys.stdout.flush()
