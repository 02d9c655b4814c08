"""The issue's FairScale examples, written as FairScale's users write them, on 2 ranks (torchrun).

Each example trains on its rank's half of every batch and must reach the parameters single-process training
on the whole batches reaches (fp32, 1e-5). Prints "parity ok" on rank 0 when every example does.
"""

import fairscale
import torch
import torch.distributed as dist
from fairscale.experimental.nn.offload import OffloadModel
from fairscale.nn import FullyShardedDataParallel, auto_wrap, enable_wrap
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim.oss import OSS
from torch import nn

STEPS, BATCH = 3, 8


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step, rank=None, world=None):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
    if rank is None:
        return x, y
    per = BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def reference(optim_cls, **kwargs):
    net = model()
    opt = optim_cls(net.parameters(), **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(net(batch(step)[0]), batch(step)[1]).backward()
        opt.step()
    return net.state_dict()


def check(name, state, expected):
    worst = max((state[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-5, f"{name}: {worst}"


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert fairscale.__version__.startswith("0.4.13")

    # OSS + ShardedDataParallel
    net = model()
    optimizer = OSS(params=net.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ddp = ShardedDataParallel(net, optimizer)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step, rank, world)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    check("OSS + ShardedDataParallel", net.state_dict(), reference(torch.optim.SGD, lr=0.1, momentum=0.9))

    # FullyShardedDataParallel, nested with auto_wrap, any optimizer
    with enable_wrap(wrapper_cls=FullyShardedDataParallel):
        wrapped = FullyShardedDataParallel(
            auto_wrap(model(), auto_wrap_policy=lambda **kw: not kw["recurse"])
        )
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step, rank, world)
        nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()
    with wrapped.summon_full_params():
        names = [name for name, _ in wrapped.named_parameters()]
    assert names == [name for name, _ in model().named_parameters()], names
    check("FullyShardedDataParallel", wrapped.state_dict(), reference(torch.optim.Adam, lr=0.01))

    # OffloadModel trained under autocast (each rank on its own; the device is the CPU here)
    def offload_run(net):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            optimizer.step()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    offloaded = OffloadModel(model=model(), device=torch.device("cpu"), offload_device=torch.device("cpu"),
                             num_slices=3, checkpoint_activation=True, num_microbatches=1)  # fmt: skip
    assert (offload_run(offloaded) - offload_run(model())).abs().max().item() < 1e-6

    if rank == 0:
        print("parity ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
