"""DeepSpeed's `AutoTP` object for rule-driven replacement: `AutoTP(module, ..., partition_config=...)`,
`set_tensor_parallel_config(mp_size, mp_group)`, `_replace_module(model)`.

It walks the model, names each linear by its full path (`layers.0.self_attn.q_proj`), finds the first
`TPLayerSpec` of the `AutoTPConfig` matching `<path>.weight` and replaces the linear: column ->
`LinearLayer` (fused parts from the spec's `shape`, output gathered with `gather_output`), row ->
`LinearAllreduce`, skip or no match -> left as it is. A linear whose weight is tied to another module stays
whole (sharding one side would untie it). Layers split over `mp_group` (None: one rank, nothing split);
`mp_size` is recorded as DeepSpeed records it.

What it does not do: DeepSpeed's policy search for models without a `partition_config` (shardspeed's
`shard_model` places layers by its built-in names instead), loading a `state_dict` while replacing, keeping
modules on the host, a tensor grain size other than 1 and vocabulary-parallel heads (the `tensor_parallel`
config block's `vocab_parallel_lm_head` does that) are refused, naming the argument.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from shardspeed.module_inject.autotp_config import AutoTPConfig, PartitionType
from shardspeed.module_inject.layers import LinearAllreduce, LinearLayer
from shardspeed.module_inject.tp_comm import group_size

__all__ = ["AutoTP"]


def _linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


class AutoTP:
    """Replaces a model's linears by the rules of a `partition_config` (see the module docstring)."""

    def __init__(self, module, all_reduce_linears=(), prefix="", state_dict=None, linear_layer_setting=None,
                 orig_layer_impl=None, keep_module_on_host=False, partition_config=None,
                 vocab_parallel_lm_head=False, model_config=None, tp_grain_size=1, training_mode=False):  # fmt: skip
        refused = {
            "partition_config=None": partition_config is None,
            "all_reduce_linears": bool(all_reduce_linears),
            "state_dict": state_dict is not None,
            "keep_module_on_host": bool(keep_module_on_host),
            "vocab_parallel_lm_head": bool(vocab_parallel_lm_head),
            "tp_grain_size": tp_grain_size != 1,
        }
        named = [name for name, bad in refused.items() if bad]
        if named:
            raise NotImplementedError(
                f"AutoTP({', '.join(named)}): only rule-driven replacement (a partition_config) is offered; "
                "shardspeed.module_inject.shard_model places layers by its built-in names, and the tensor_parallel "
                "config block shards at initialize"
            )
        if isinstance(partition_config, dict):
            partition_config = AutoTPConfig.from_dict(partition_config)
        self.module, self.prefix, self.partition_config = module, prefix, partition_config
        self.model_config = model_config if model_config is not None else getattr(module, "config", None)
        self.training_mode = training_mode
        self.mp_size, self.mp_group = 1, None

    def set_tensor_parallel_config(self, mp_size, mp_group) -> None:
        if mp_group is not None and dist.get_world_size(mp_group) != mp_size:
            raise ValueError(
                f"AutoTP: mp_size {mp_size} differs from the group's {dist.get_world_size(mp_group)} ranks"
            )
        self.mp_size, self.mp_group = mp_size, mp_group

    def update_linear_policies(self) -> None:
        """DeepSpeed builds its linear policies here; with a partition_config the rules are the policy."""

    def _get_model_type(self) -> str | None:
        model_type = getattr(self.model_config, "model_type", None)
        return str(model_type).lower() if model_type is not None else None

    def _tied(self, child: nn.Module) -> bool:
        weight = child.weight
        return sum(1 for m in self.module.modules() if m._parameters.get("weight") is weight) > 1

    def _replace_with_config(self, child: nn.Module, full_name: str):
        """The replacement of the linear `child` named `full_name`, or `child` itself when it stays whole."""
        spec = self.partition_config.find_matching_spec(full_name + ".weight", self._get_model_type())
        if spec is None or spec.partition_type is PartitionType.SKIP or self._tied(child):
            return child
        transposed = type(child).__name__ == "Conv1D"
        rank = dist.get_rank(self.mp_group) if group_size(self.mp_group) > 1 else 0
        if spec.partition_type is PartitionType.ROW:
            layer = LinearAllreduce.from_module(child, self.mp_group, rank, transposed)
        else:
            layer = LinearLayer.from_module(
                child, self.mp_group, rank, self._segments(spec, child), transposed
            )
            layer.gather_output = spec.gather_output
        layer.name = full_name
        return layer

    @staticmethod
    def _segments(spec, child: nn.Module):
        """The fused parts' sizes from the spec's `shape` (`(parts, -1)` or `((q, k, v), -1)`), or None."""
        parts = spec.shape[spec.get_partition_dim()] if spec.shape is not None else None
        if isinstance(parts, tuple):
            return parts
        if isinstance(parts, int) and parts > 0:
            size = child.weight.shape[1 if type(child).__name__ == "Conv1D" else 0]
            return (size // parts,) * parts
        return None

    def _replace_module(self, model: nn.Module, prefix: str = ""):
        """Replace the linears under `model` (names from `model` down), in place; returns `model`."""
        for name, child in list(model.named_children()):
            full_name = f"{prefix}.{name}" if prefix else name
            if _linear(child):
                replacement = self._replace_with_config(child, full_name)
                if replacement is not None and replacement is not child:
                    setattr(model, name, replacement)
            else:
                self._replace_module(child, full_name)
        return model
