"""One pipeline training script for DeepSpeed 0.19.8 and for shardspeed: a tiny `PipelineModule` (odd layer
sizes, 2 stages), Adam and WarmupLR, ZeRO stage 0 or 1 (what DeepSpeed's PipelineEngine runs); train, save,
go on; or resume and go on. It records the same things whichever library runs it, as run_script.py does.

    python pipe_script.py --world 2 --stages 2 --stage 1 --save DIR --out result.pt     # train, save, go on
    python pipe_script.py --world 2 --stages 2 --stage 1 --load DIR --out result.pt     # resume, go on

The data of step k is a fixed global batch of 8 samples seeded by k, cut into micro-batches of 2 (gradient
accumulation 4 at one replica, 2 at two), so runs at any data-parallel degree see the same data.
`result.pt`: `losses` (each step's mean loss), `weights` (every parameter, fp32, gathered to rank 0 from the
stages holding it) and `counters`.
"""

import argparse
import os
import socket
import sys

import torch

GLOBAL_BATCH, MICRO, SAVE_AT, STEPS_AFTER = 8, 2, 3, 3


def layers(deepspeed) -> list:
    spec = deepspeed.pipe.LayerSpec
    return [spec(torch.nn.Linear, 5, 7), spec(torch.nn.Tanh), spec(torch.nn.Linear, 7, 9), spec(torch.nn.Tanh),
            spec(torch.nn.Linear, 9, 7), spec(torch.nn.Tanh), spec(torch.nn.Linear, 7, 3)]  # fmt: skip


def config(world: int, stages: int, stage: int, dtype: str = "fp32") -> dict:
    replicas = world // stages
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GLOBAL_BATCH // (MICRO * replicas),
        "optimizer": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }  # fmt: skip
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def micro_batches(step: int, replica: int, replicas: int, dtype=torch.float32):
    """This replica's micro-batches of step `step` (the global batch is the same at every degree)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=g)
    y = torch.randn(GLOBAL_BATCH, 3, generator=g)
    per = GLOBAL_BATCH // replicas
    x, y = x[replica * per : (replica + 1) * per].to(dtype), y[replica * per : (replica + 1) * per]
    return iter([(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, per, MICRO)])


def train_step(engine, step: int) -> float:
    import torch.distributed as dist

    replicas = engine.grid.get_data_parallel_world_size()
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    loss = engine.train_batch(micro_batches(step, engine.grid.get_data_parallel_rank(), replicas, dtype))
    # train_batch's loss is the last stage's mean over the replica's micro-batches, broadcast in the pipeline
    mean = loss.detach().clone().float()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def full_weights(engine, deepspeed, out: str) -> dict:
    """Every parameter by name, fp32 (the fp32 master in bf16), on rank 0: each rank writes what its stage
    holds next to `out` (no object collectives: they need numpy), rank 0 merges."""
    import torch.distributed as dist

    rank = dist.get_rank()
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if engine.bfloat16_enabled():  # every rank of the stage's data-parallel group asks, in the same order
        for name, param in engine.module.named_parameters():
            master = deepspeed.utils.safe_get_full_fp32_param(param)
            if master is not None:
                weights[name] = master.detach().float().clone()
    torch.save(weights, f"{out}.{rank}")
    dist.barrier()
    merged = {}
    if rank == 0:
        for r in range(dist.get_world_size()):
            merged.update(torch.load(f"{out}.{r}"))
    dist.barrier()
    os.remove(f"{out}.{rank}")
    return dict(sorted(merged.items()))


def run(deepspeed, world: int, stages: int, stage: int, out: str, save=None, load=None, dtype="fp32") -> dict:
    """In every rank: train, save, go on (`save`), or resume from `load` and go on; what `result.pt` holds
    (the weights on rank 0 only; `out` names the temporary files they are gathered through)."""
    torch.manual_seed(0)
    module = deepspeed.pipe.PipelineModule(
        layers=layers(deepspeed), num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform"
    )
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=config(world, stages, stage, dtype),
    )  # fmt: skip
    if load:
        path, client = engine.load_checkpoint(load)
        assert path is not None, f"no checkpoint in {load}"
        assert client.get("epoch") == 7, f"client state not restored: {sorted(client)}"
        first = engine.global_steps
    else:
        for step in range(SAVE_AT):
            train_step(engine, step)
        engine.save_checkpoint(save, client_state={"epoch": 7})
        first = SAVE_AT
    losses = [train_step(engine, step) for step in range(first, first + STEPS_AFTER)]
    counters = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "lr": engine.get_lr()[0]}  # fmt: skip
    return {"losses": losses, "weights": full_weights(engine, deepspeed, out), "counters": counters}


def rank_main(rank, args, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    result = run(
        deepspeed,
        args.world,
        args.stages,
        args.stage,
        args.out,
        save=args.save,
        load=args.load,
        dtype=args.dtype,
    )
    if rank == 0:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage (0 or 1)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if bool(args.save) == bool(args.load):
        parser.error("give exactly one of --save and --load")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args, port), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
