"""DeepSpeed-Chat's own ZeRO-3 save (`dschat.utils.utils.save_zero_three_model`, unchanged) on a shardspeed
engine after training steps with an eval pass between them, as its step-1 script runs them.

    git -C <DeepSpeedExamples clone> archive HEAD applications/DeepSpeed-Chat/dschat | tar x -C /tmp/dschat
    torchrun --nproc_per_node 2 benchmarks/dschat_zero3_save.py \\
        --dschat /tmp/dschat/applications/DeepSpeed-Chat --out /tmp/dschat_out

Needs transformers and the `deepspeed` alias (integrations/deepspeed-alias) installed. A tiny OPT (tied
embedding and head, as DeepSpeed-Chat's default actor) is built from a config; nothing is downloaded. The
function gathers only the parameters whose `ds_status` is NOT_AVAILABLE and reads `.data` of the rest, so a
parameter left INFLIGHT with empty data is written empty. Prints how many tensors the file holds, how many are
empty, and how many differ from the engine's own 16-bit export of the same weights.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dschat", required=True, help="DeepSpeed-Chat's folder (holds dschat/)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, args.dschat)
    import deepspeed
    from dschat.utils.utils import save_zero_three_model
    from transformers import OPTConfig, OPTForCausalLM

    deepspeed.init_distributed()
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                       max_position_embeddings=64, word_embed_proj_dim=32)  # fmt: skip
    ds_config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "bf16": {"enabled": True}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=OPTForCausalLM(config), config=ds_config)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
        engine.train()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.eval()
        with torch.no_grad():
            engine(input_ids=ids, labels=ids)
    save_zero_three_model(engine, dist.get_rank(), args.out, zero_stage=3)
    export = engine._zero3_consolidated_16bit_state_dict()
    if dist.get_rank() == 0:
        saved = torch.load(os.path.join(args.out, "pytorch_model.bin"))
        empty = [k for k, v in saved.items() if v.numel() == 0]
        differ = [k for k, v in saved.items() if not torch.equal(v, export[k])]
        weights = sum(v.numel() for v in saved.values())
        print(
            f"saved {len(saved)} tensors ({weights} weights): {len(empty)} empty, {len(differ)} differ from the export"
        )
    dist.barrier()


if __name__ == "__main__":
    main()
