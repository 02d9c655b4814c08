"""One MoE training script for DeepSpeed 0.19.8 and for shardspeed (through the `deepspeed` alias): a tiny
model with one `deepspeed.moe.layer.MoE` layer (2 experts, top-1 gating), Adam and WarmupLR, trained for 3
steps, saved, and trained 3 more; or resumed from a checkpoint and trained on.

    python moe_script.py --world 2 --ep 2 --stage 2 --save DIR --out result.pt      # train, save, go on
    python moe_script.py --world 2 --ep 1 --stage 0 --load DIR --out result.pt      # resume, go on
    python moe_script.py --world 2 --jobs jobs.json     # several of those (a JSON list of their options)

Gating drops no token (capacity factor = number of experts) and picks no token at random (`use_rts=False`),
so that a run's arithmetic does not depend on RNG streams, which DeepSpeed does not save. The loss is the
regression loss plus 0.01 x the gate's load-balancing loss (`--aux`), so the gate trains too; that loss is
computed over a rank's own tokens, so runs at different world sizes differ by it (not at different ep sizes). The data are those of
run_script.py (step k: a fixed global batch of 8 samples split between the ranks). `result.pt` holds what
run_script.py's does: `losses`, `weights` (every parameter of the model, experts under their global index
`moe.deepspeed_moe.experts.deepspeed_experts.<E>.*`, gathered from every rank) and `counters`.
"""

import argparse
import json
import os
import socket
import sys

import torch

try:
    from deepspeed_interop.run_script import GLOBAL_BATCH, SAVE_AT, STEPS_AFTER, batch
except ImportError:  # run as a script
    from run_script import GLOBAL_BATCH, SAVE_AT, STEPS_AFTER, batch

NUM_EXPERTS = 2
AUX = 0.01  # weight of the load-balancing loss (a rank's own tokens: it changes with the world size)
EXPERTS = "moe.deepspeed_moe.experts.deepspeed_experts."


class TinyMoE(torch.nn.Module):
    def __init__(self, deepspeed, ep_size: int):
        super().__init__()
        self.inp = torch.nn.Linear(5, 6)
        expert = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 6))
        self.moe = deepspeed.moe.layer.MoE(
            hidden_size=6, expert=expert, num_experts=NUM_EXPERTS, ep_size=ep_size, k=1,
            capacity_factor=float(NUM_EXPERTS), eval_capacity_factor=float(NUM_EXPERTS), min_capacity=1,
            use_rts=False,
        )  # fmt: skip
        self.out = torch.nn.Linear(6, 3)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, 3))

    def forward(self, x):
        hidden, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(torch.tanh(hidden)) + self.offset, l_aux


def config(world: int, stage: int, dtype: str = "fp32") -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }  # fmt: skip
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_step(engine, step: int, aux: float = AUX) -> float:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step, rank, world, torch.bfloat16 if engine.bfloat16_enabled() else torch.float32)
    prediction, l_aux = engine(x)
    loss = torch.nn.functional.mse_loss(prediction.float(), y) + aux * l_aux.float()
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def full_weights(module, ep_size: int, masters=None) -> dict:
    """Every parameter, experts under their global index, gathered from the ranks that hold them; in bf16 the
    fp32 masters `masters(param)` gives, where it gives one."""
    import torch.distributed as dist

    world = dist.get_world_size()
    gathered = [
        {} for _ in range(world)
    ]  # every rank has the same names and shapes (its own experts' values)
    for name, p in module.named_parameters():
        pieces = [torch.empty_like(p, dtype=torch.float32) for _ in range(world)]
        master = masters(p) if masters is not None else None
        dist.all_gather(pieces, (p if master is None else master).detach().float().contiguous())
        for rank in range(world):
            gathered[rank][name] = pieces[rank]
    per_rank = NUM_EXPERTS // ep_size
    out = {}
    for rank, weights in enumerate(gathered):
        ep_rank = rank % ep_size  # DeepSpeed's expert-parallel groups are consecutive ranks
        for name, value in weights.items():
            if name.startswith(EXPERTS):
                local_id, rest = name[len(EXPERTS) :].split(".", 1)
                name = f"{EXPERTS}{ep_rank * per_rank + int(local_id)}.{rest}"
            out.setdefault(name, value)
    return out


def run(deepspeed, world: int, ep: int, stage: int, save: str | None = None, load: str | None = None,
        aux: float = AUX, dtype: str = "fp32") -> dict:  # fmt: skip
    """In every rank of an initialised process group: train and save then go on (`save`), or resume from
    `load` and go on. Returns what `result.pt` holds."""
    torch.manual_seed(0)
    model = TinyMoE(deepspeed, ep)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=config(world, stage, dtype)
    )
    if load:
        path, client = engine.load_checkpoint(load)
        assert path is not None, f"no checkpoint in {load}"
        assert client.get("epoch") == 7, f"client state not restored: {sorted(client)}"
        first = engine.global_steps
    else:
        for step in range(SAVE_AT):
            train_step(engine, step, aux)
        engine.save_checkpoint(save, client_state={"epoch": 7})
        first = SAVE_AT
    losses = [train_step(engine, step, aux) for step in range(first, first + STEPS_AFTER)]
    counters = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "lr": engine.get_lr()[0]}  # fmt: skip
    masters = deepspeed.utils.safe_get_full_fp32_param if dtype == "bf16" else None
    return {"losses": losses, "weights": full_weights(engine.module, ep, masters), "counters": counters}


def rank_main(rank, args, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    for job in args.jobs:  # several runs share the start-up of one process group
        result = run(deepspeed, args.world, job["ep"], job["stage"], save=job.get("save"), load=job.get("load"),
                     aux=job.get("aux", AUX), dtype=job.get("dtype", "fp32"))  # fmt: skip
        if rank == 0:
            torch.save(result, job["out"])
        dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--out")
    parser.add_argument("--aux", type=float, default=AUX, help="weight of the gate's load-balancing loss")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--jobs", help="a JSON file: a list of {ep, stage, save or load, out, aux, dtype}, run in turn"
    )
    args = parser.parse_args(argv)
    if args.jobs:
        with open(args.jobs) as f:
            args.jobs = json.load(f)
    else:
        if bool(args.save) == bool(args.load) or not args.out:
            parser.error("give --jobs, or --out and exactly one of --save and --load")
        args.jobs = [{"ep": args.ep, "stage": args.stage, "save": args.save, "load": args.load, "out": args.out,
                      "aux": args.aux, "dtype": args.dtype}]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args, port), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())
