"""One training script for DeepSpeed 0.19.8 and for shardspeed (through the `deepspeed` alias): train a tiny
model with Adam and a WarmupLR schedule, save a checkpoint, go on training; or resume from a checkpoint and go
on training. Whichever library runs it, it records the same things, so one library's resumed run can be
compared with the other's uninterrupted run.

    python run_script.py --world 2 --stage 2 --dtype fp32 --save DIR --out result.pt       # train, save, go on
    python run_script.py --world 1 --stage 1 --dtype fp32 --load DIR --out result.pt       # resume, go on
    python run_script.py --world 2 --jobs jobs.json        # several of those (a JSON list of their options)

It starts its own `--world` ranks (spawned, Gloo on loopback). The data of step k is a fixed global batch of
8 samples drawn from a generator seeded by k and split between the ranks, so runs at 1, 2 and 4 ranks see the
same data. `result.pt` holds, after the save (or load): `losses` (each step's loss averaged over the global
batch), `weights` (every parameter in fp32 at the end: the fp32 master where there is one) and `counters`.
"""

import argparse
import json
import os
import socket
import sys

import torch

GLOBAL_BATCH, SAVE_AT, STEPS_AFTER = 8, 3, 3


class Tiny(torch.nn.Module):
    """Odd sizes, so that ZeRO's flat partitions need padding; a buffer, so that buffers round-trip."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(5, 7)
        self.hidden = torch.nn.Linear(7, 7)
        self.out = torch.nn.Linear(7, 3)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, 3))

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x))))) + self.offset


def config(args) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // args.world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 1000,
    }  # fmt: skip
    if args.stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def batch(step: int, rank: int, world: int, dtype):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g)
    y = torch.randn(GLOBAL_BATCH, 3, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per].to(dtype), y[rank * per : (rank + 1) * per]


def train_step(engine, step: int, dtype) -> float:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step, rank, world, dtype)
    loss = torch.nn.functional.mse_loss(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def full_weights(engine, deepspeed) -> dict:
    """Every parameter in fp32 (the fp32 master where the optimizer keeps one), whole, on every rank."""
    module = engine.module
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        out = {n: p.detach().float().clone() for n, p in params.items()}
    if engine.bfloat16_enabled() or engine.fp16_enabled():
        for name, param in params.items():
            master = deepspeed.utils.safe_get_full_fp32_param(param)
            if master is not None:
                out[name] = master.detach().float().clone()
    return out


def run(
    deepspeed, world: int, stage: int, dtype: str, save: str | None = None, load: str | None = None
) -> dict:
    """In every rank of an initialised process group: train and save then go on (`save`), or resume from
    `load` and go on. Returns what `result.pt` holds (see the module's docstring)."""
    args = argparse.Namespace(world=world, stage=stage, dtype=dtype)
    torch.manual_seed(0)
    model = Tiny()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(args)
    )
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if load:
        path, client = engine.load_checkpoint(load)
        assert path is not None, f"no checkpoint in {load}"
        assert client.get("epoch") == 7, f"client state not restored: {sorted(client)}"
        first = engine.global_steps
    else:
        for step in range(SAVE_AT):
            train_step(engine, step, torch_dtype)
        engine.save_checkpoint(save, client_state={"epoch": 7})
        first = SAVE_AT
    losses = [train_step(engine, step, torch_dtype) for step in range(first, first + STEPS_AFTER)]
    weights = full_weights(engine, deepspeed)
    counters = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "lr": engine.get_lr()[0]}  # fmt: skip
    return {"losses": losses, "weights": weights, "counters": counters}


def rank_main(rank, args, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    for job in args.jobs:  # several runs share the start-up of one process group
        result = run(
            deepspeed, args.world, job["stage"], job["dtype"], save=job.get("save"), load=job.get("load")
        )
        if rank == 0:
            torch.save(result, job["out"])
        dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--out")
    parser.add_argument(
        "--jobs", help="a JSON file: a list of {stage, dtype, save or load, out}, run in turn"
    )
    args = parser.parse_args(argv)
    if args.jobs:
        with open(args.jobs) as f:
            args.jobs = json.load(f)
    else:
        if bool(args.save) == bool(args.load) or not args.out:
            parser.error("give --jobs, or --out and exactly one of --save and --load")
        args.jobs = [
            {"stage": args.stage, "dtype": args.dtype, "save": args.save, "load": args.load, "out": args.out}
        ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args, port), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
