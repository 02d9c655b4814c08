"""Train a small Evoformer (model.py) with shardspeed: ZeRO-2, bf16, activation checkpointing per block.

    shardspeed --num_gpus 2 examples/evoformer/train.py --deepspeed_config examples/evoformer/ds_config.json
    python examples/evoformer/train.py --deepspeed_config examples/evoformer/ds_config.json --attention plain

Every attention of the stack (MSA row with pair bias, MSA column, both triangle attentions) goes through
`deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention`; `--attention plain` swaps in the plain
implementation that holds the whole [batch, rows, heads, cols, cols] logits. The data are synthetic MSAs
(model.SyntheticMSA): nothing to download. Runs on CPU (Gloo) or GPUs (NCCL) unchanged.
"""

from __future__ import annotations

import argparse
import time

# shardspeed first: it quiets torch's import-time warning about NumPy, which a clean install does not have.
import shardspeed as deepspeed  # isort: skip
import torch
from model import ATTENTIONS, Evoformer, SyntheticMSA
from tqdm import tqdm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--n_seq", type=int, default=8, help="MSA rows")
    parser.add_argument("--n_res", type=int, default=32, help="residues")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--c_m", type=int, default=32)
    parser.add_argument("--c_z", type=int, default=16)
    parser.add_argument("--attention", choices=sorted(ATTENTIONS), default="evoformer")
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Evoformer(blocks=args.blocks, c_m=args.c_m, c_z=args.c_z, attention=args.attention)
    dataset = SyntheticMSA(size=4096, n_seq=args.n_seq, n_res=args.n_res)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, training_data=dataset)
    if deepspeed.checkpointing.is_configured():  # the config has an "activation_checkpointing" block
        model.checkpoint_fn = deepspeed.checkpointing.checkpoint
    rank = deepspeed.comm.get_rank()
    dtype = next(engine.module.parameters()).dtype
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{params / 1e3:.0f}K parameters, MSA {args.n_seq} x {args.n_res}, {engine.world_size} processes, "
              f"ZeRO stage {engine.zero_optimization_stage()}, {dtype}, attention {args.attention}, "
              f"checkpointing {model.checkpoint_fn is not None}")  # fmt: skip

    batches = iter(deepspeed.RepeatingLoader(loader))
    progress = tqdm(total=args.steps, disable=rank != 0, desc="training", unit="step")
    start, losses = time.perf_counter(), []
    for _ in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            batch = {key: value.to(engine.device) for key, value in next(batches).items()}
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        progress.update()
    progress.close()
    if rank == 0:
        head, tail = losses[: max(1, len(losses) // 5)], losses[-max(1, len(losses) // 5) :]
        print(f"loss {sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f} (mean of the first and last "
              f"fifth of the steps); {time.perf_counter() - start:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
