"""Predict per-rank model-state memory before training: `python -m shardspeed.zero.estimate`.

DeepSpeed's names are provided too: `estimate_zero2_model_states_mem_needs_all_live(model, ...)` and
`estimate_zero3_model_states_mem_needs_all_live(model, ...)` print the table for a model.
"""

from __future__ import annotations

import argparse

from torch import nn

from shardspeed.core.memory import estimate, format_estimate


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1) -> None:  # fmt: skip
    print(format_estimate(_count(model), num_gpus_per_node * num_nodes, "fp16"))


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1) -> None:  # fmt: skip
    print(format_estimate(_count(model), num_gpus_per_node * num_nodes, "fp16"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="per-rank model-state memory of Adam training under ZeRO")
    parser.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 1.3e9")
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp16")
    parser.add_argument(
        "--stage", type=int, choices=[0, 1, 2, 3], default=None, help="one stage (default: all)"
    )
    args = parser.parse_args(argv)
    if args.stage is None:
        print(format_estimate(int(args.params), args.world_size, args.dtype))
    else:
        for key, value in (
            estimate(int(args.params), args.world_size, args.stage, args.dtype).as_dict().items()
        ):
            print(f"{key:>16}: {value / 2**20:,.1f} MiB")


if __name__ == "__main__":
    main()
