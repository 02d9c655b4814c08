"""A DeepSpeed-style training script for the autotuner's tests: `deepspeed.initialize` from
`--deepspeed_config`, then `--steps` optimizer steps of a small MLP on CPU (Gloo).

`--fail_above_mbs N` makes a run with a micro-batch larger than N fail the way an out-of-memory run does
(an exception in the first forward), so that the tests see the autotuner record and skip it. `--report`
names a JSON file where rank 0 writes the config the engine trained with and how many steps it took (what
`--autotuning run` is checked against). An experiment never gets that far: its engine ends the run after
the profiled steps.
"""

import argparse
import json

import torch

import shardspeed as deepspeed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fail_above_mbs", type=int, default=0)
    parser.add_argument("--report", default="")
    parser.add_argument("--width", type=int, default=32)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()  # Gloo on CPU, NCCL on GPUs
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs = engine.train_micro_batch_size_per_gpu()
    if args.fail_above_mbs and mbs > args.fail_above_mbs:
        raise RuntimeError(f"simulated out of memory: micro-batch {mbs} > {args.fail_above_mbs}")
    data = torch.Generator().manual_seed(1)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x = torch.randn(mbs, 16, generator=data)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if args.report and engine.global_rank == 0:
        with open(args.report, "w") as handle:
            json.dump({"config": engine.config, "global_steps": engine.global_steps}, handle)


if __name__ == "__main__":
    main()
