"""A tiny fixed-seed data-parallel training job for the launcher tests (plain torch.distributed, Gloo).

Each step every rank takes its share of a fixed global batch, all-reduces the gradients (mean) and takes
an SGD step. With the same world size the result does not depend on how ranks are spread over nodes, so
the multi-node runs are compared with the single-node one. Rank 0 writes the final parameters and what
every rank saw (env, argv, which ssh address it came in on) as JSON to --out.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import shardspeed.comm
from shardspeed.comm.collectives import all_gather_strings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--extra", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shardspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1234)
    global_batch = 8
    for _ in range(args.steps):
        x = torch.randn(global_batch, 6, generator=data)
        y = torch.randn(global_batch, 1, generator=data)
        share = global_batch // world
        mine = slice(rank * share, (rank + 1) * share)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        optimizer.step()

    seen = {
        "rank": rank,
        "local_rank_arg": args.local_rank,
        "extra": args.extra,
        "env": {
            k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "CROSS_RANK", "LOCAL_SIZE", "MASTER_ADDR")
        },
        "ssh_server": (os.environ.get("SSH_CONNECTION") or "- - local").split()[2],
    }
    # all_gather_object needs NumPy, which a clean install does not have.
    everyone = [json.loads(text) for text in all_gather_strings(json.dumps(seen), torch.device("cpu"))]
    if rank == 0:
        params = [p.detach().flatten().tolist() for p in model.parameters()]
        with open(args.out, "w") as handle:
            json.dump({"world_size": world, "params": params, "ranks": everyone}, handle)
    dist.barrier()  # leave together; init_distributed's exit hook takes care of Gloo's threads


if __name__ == "__main__":
    main()
