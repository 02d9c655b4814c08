"""A DeepSpeed 0.18.9 compression script, written from its tutorial and its unit test (the BERT layer names,
the test's ``compression_training`` config on CPU): it runs as is after ``import shardspeed as deepspeed``.

    python tests/compression_ds_script.py --steps 6 --out result.pt [--no-sparse]

1. build a small BERT-style model and ``init_compression(model, ds_config)``;
2. ``deepspeed.initialize`` and train: the engine steps the compression scheduler;
3. evaluate, ``redundancy_clean(model, ds_config)``, evaluate again; write losses, logits and shapes to --out.

With ``import deepspeed`` (DeepSpeed 0.18.9) instead, the same script stops at its first engine step with
``KeyError: 'schedule_offset_end'`` (its config fills that key only for snip_momentum); ``--no-sparse``
drops the l1 sparse-pruning group so the rest can be compared side by side.
"""

import argparse
import os
import sys

import shardspeed as deepspeed  # the only line that differs from the DeepSpeed script  # isort: skip
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression_common import Bert, batches


def ds_config(sparse: bool) -> dict:
    """DeepSpeed's test config (tests/unit/compression/test_compression.py at v0.18.9), made to run on a CPU:
    fp32 with torch's AdamW, hence quantize_weight_in_forward (0.18.9 requires it without fp16), start_bits equal to
    target_bits (0.18.9 ignores start_bits in that mode), dropout-free, no head pruning (topk scores draw
    random numbers in another order there)."""
    compression = {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True, "quantizer_kernel": False, "schedule_offset": 2, "quantize_groups": 4,
                "quantize_verbose": False, "quantization_type": "asymmetric", "rounding": "nearest",
                "quantize_weight_in_forward": True,
                "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001},
            },
            "different_groups": {
                "wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 50},
                        "modules": ["attention.self", "intermediate"]},
                "wq2": {"params": {"start_bits": 4, "target_bits": 4, "quantization_period": 50},
                        "modules": ["attention.output"]},
            },
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "quantization_type": "asymmetric",
                                  "range_calibration": "dynamic", "schedule_offset": 2},
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attention.output"]}},
        },
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 3, "method": "l1"},
            "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.self"]}},
        },
        "row_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 1, "method": "l1"},
            "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"],
                                         "related_modules": [["layer.\\w+.output.dense"]]}},
        },
    }  # fmt: skip
    if not sparse:
        del compression["sparse_pruning"]
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "compression_training": compression,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-sparse", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    config = ds_config(sparse=not args.no_sparse)

    torch.manual_seed(0)
    model = Bert()
    model = deepspeed.compression.compress.init_compression(model, config)
    assert isinstance(
        model.layer[0].attention.self.query, deepspeed.compression.basic_layer.LinearLayer_Compress
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2
    )  # built after init_compression: scores included
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for tokens in batches(args.steps):
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    model.eval()
    tokens = batches(1, seed=1)[0][:, :-1]
    with torch.no_grad():
        before = model.logits(tokens)
    model = deepspeed.compression.compress.redundancy_clean(model, config)
    with torch.no_grad():
        after = model.logits(tokens)
    getattr_ = deepspeed.compression.helper.recursive_getattr
    shapes = {
        name: tuple(getattr_(model, name).weight.shape)
        for name in ("layer.0.intermediate.dense", "layer.0.output.dense", "layer.0.attention.self.query")
    }
    torch.save({"losses": losses, "before": before, "after": after, "shapes": shapes}, args.out)
    print(
        f"losses {[round(x, 4) for x in losses]}; clean changed the logits by {(after - before).abs().max():.2e}"
    )


if __name__ == "__main__":
    main()
