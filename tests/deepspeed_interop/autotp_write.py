"""DeepSpeed 0.19.8 side of tests/integrations/test_deepspeed_autotp_universal.py: an AutoTP run (tp 2, ZeRO 1,
fp32, 2 CPU ranks over Gloo) of a small attention block, trained 3 steps and saved with tag "t".

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 autotp_write.py OUT_DIR
"""

import sys

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.o_proj(self.q_proj(x) + self.k_proj(x) * self.v_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.self_attn, self.norm = Attention(hidden), nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(self.self_attn(x))


class Model(nn.Module):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.layers = nn.ModuleList([Layer(hidden)])

    def forward(self, x):
        return self.layers[0](x).pow(2).mean()


def main(out: str) -> None:
    import deepspeed  # here: shardspeed's side imports the model classes without DeepSpeed installed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Model()
    specs = [{"patterns": [r".*\.(q|k|v)_proj\.weight$"], "partition_type": "column"},
             {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"}]  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "tensor_parallel": {
            "autotp_size": 2,
            "partition_config": {"use_default_specs": False, "layer_specs": specs},
        },
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = torch.Generator().manual_seed(1)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 8, generator=batches)))
        engine.step()
    engine.save_checkpoint(out, tag="t")


if __name__ == "__main__":
    main(sys.argv[1])
