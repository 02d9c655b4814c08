"""The engine's tensor-parallel part: shards the model at `initialize`, and combines gradient norms.

`TensorParallel.shard(model, grid, config)` makes every tensor rank start from tensor rank 0's full
weights (one broadcast; meta tensors are skipped), then shards the model with AutoTP: by the config's
`partition_config` when it has one, else by the model's Hugging Face tp_plan when it has one (module_inject/
tp_plan.py), else by AutoTP's built-in layer names.
`attach(optimizer, device)` installs the global-norm hook on the engine's optimizer wrapper.
`tp_model_init` (DeepSpeed 0.19.8's `deepspeed.tp_model_init`) only records its arguments on the model, as
in DeepSpeed; `merge_tp_model_init` merges them into the config's `tensor_parallel` block at `initialize`.

Gradient norm: the wrapper's norm on tensor rank r covers this rank's shards (S_r) and the replicated
parameters (R, identical on every tensor rank, since their inputs and incoming gradients are). The global
norm counts every shard once and the replicated parameters once:
    global^2 = sum_r (S_r + R) - (t - 1) * R
so each rank all-reduces its norm^2 minus (t-1)/t of R over the tensor group. R is read from the reduced
gradient buffers (stage 0: whole buckets; stages 1-2: this rank's shard of each bucket, summed over the
data axis).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from shardspeed import accelerator
from shardspeed.config import ConfigError
from shardspeed.core.layout import tensor_group
from shardspeed.module_inject.auto_tp import TPReport, shard_model
from shardspeed.module_inject.tp_plan import TPPlanConverter, hf_tp_plan
from shardspeed.module_inject.tp_state import partitions_of, universal_checkpoint_info
from shardspeed.pipe.module import PipelineModule
from shardspeed.utils.logging import log_dist

__all__ = ["TensorParallel", "merge_tp_model_init", "prepare_tensor_parallel", "tp_model_init"]


def tp_model_init(model, tp_size, dtype, config=None, **kwargs):
    """Record `tp_size` (and `dtype`, `config`) for `initialize`, which does the sharding. Returns `model`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tp_model_init: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if kwargs.get("tp_group") is not None:
        raise ValueError(
            "tp_model_init(tp_group=...): pass the layout through the config's tensor_parallel block"
        )
    model._shardspeed_tp_model_init = {"tp_size": tp_size, "dtype": dtype, "config": config}
    return model


def merge_tp_model_init(raw: dict, model):
    """The config dict with `tp_model_init`'s recorded arguments merged into `tensor_parallel`, and the
    tensor degree. The dict is returned untouched when neither asks for tensor parallelism."""
    recorded = getattr(model, "_shardspeed_tp_model_init", None)
    block = raw.get("tensor_parallel") if isinstance(raw, dict) else None
    size = block.get("autotp_size", 0) if isinstance(block, dict) else 0
    if recorded is None:
        size = size if isinstance(size, int) and size > 1 else 1
        if size > 1 and isinstance(model, PipelineModule):
            raise ConfigError(
                "tensor_parallel.autotp_size: AutoTP cannot be combined with a PipelineModule yet"
            )
        return raw, size
    if size not in (0, 1, recorded["tp_size"]):
        raise ConfigError(
            f"tensor_parallel.autotp_size: {size} conflicts with tp_model_init(tp_size={recorded['tp_size']})"
        )
    merged = dict(raw)
    merged["tensor_parallel"] = {**(block or {}), "autotp_size": recorded["tp_size"]}
    return merged, max(1, recorded["tp_size"])


def prepare_tensor_parallel(config, model, grid, model_parameters, optimizer):
    """`initialize`'s tensor-parallel step (collective over the tensor group): the sharded model's part, and
    the client's parameters / optimizer pointed at the shards. Returns (part, model_parameters)."""
    part = TensorParallel.shard(model, grid, config)
    if isinstance(optimizer, torch.optim.Optimizer):
        part.remap_optimizer(optimizer)
    return part, part.remap(model_parameters)


class TensorParallel:
    """Tensor-parallel state the engine holds: the group, this rank's place, what AutoTP did."""

    def __init__(self, group, report: TPReport, model, old_names: dict[int, str] | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.report = report
        self.partitions = partitions_of(model)  # state-dict name -> TPPartition
        self.optimizer = None  # the stage wrapper whose gradient norm this completes (`attach`)
        self.device = None
        self.universal_info = None  # the layout for universal checkpoints (set by `shard`)
        # parameters handed to initialize before sharding -> their sharded replacements, by name
        current = dict(model.named_parameters(remove_duplicate=False))
        self._replacement = {i: current[n] for i, n in (old_names or {}).items() if n in current}

    @classmethod
    def shard(cls, model, grid, config) -> TensorParallel:
        block = config.tensor_parallel
        _check_supported(config)
        group = tensor_group(grid)
        old_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        _broadcast_from_first_tensor_rank(model, group)
        partition = block.partition_config
        plan_specs = _hf_plan_specs(model) if partition is None else None
        if plan_specs is not None:  # the model's own complete layout: what it leaves out stays whole
            rules = {"layer_specs": plan_specs, "use_default_specs": False, "replicate_unmatched": True}
        elif partition is not None:
            rules = {"layer_specs": partition.layer_specs, "use_default_specs": partition.use_default_specs}
        else:
            rules = {}
        report = shard_model(model, group, vocab_parallel=bool(block.vocab_parallel_lm_head), **rules)
        log_dist(report.summary())
        part = cls(group, report, model, old_names)
        # DeepSpeed keeps the layout on the model (`model.universal_checkpoint_info`) and in its checkpoints
        part.universal_info = universal_checkpoint_info(model)
        model.universal_checkpoint_info = part.universal_info
        return part

    def remap(self, model_parameters):
        """`initialize(model_parameters=...)` (tensors or param-group dicts) with sharded parameters."""
        if model_parameters is None or isinstance(model_parameters, torch.Tensor):
            return self._replacement.get(id(model_parameters), model_parameters)
        out = []
        for item in model_parameters:
            if isinstance(item, dict):
                out.append({**item, "params": self.remap(list(item["params"]))})
            else:
                out.append(self._replacement.get(id(item), item))
        return out

    def remap_optimizer(self, optimizer) -> None:
        """A torch optimizer built on the unsharded parameters now steps the shards (before any step)."""
        if optimizer.state:
            raise ValueError("initialize: the optimizer passed with tensor_parallel.autotp_size > 1 has already "
                             "stepped; build it after sharding or pass it as a callable")  # fmt: skip
        for group in optimizer.param_groups:
            group["params"] = [self._replacement.get(id(p), p) for p in group["params"]]

    def attach(self, optimizer, device: torch.device) -> None:
        """Complete the norms of the stage wrapper `optimizer` (None: none) whose gradients live on `device`."""
        self.optimizer, self.device = optimizer, device
        if optimizer is not None and getattr(optimizer, "domains", None):
            # MoE: the dense domain holds the tensor shards; expert norms combine over their expert groups
            self.optimizer = optimizer.domain("dense").wrapper
        if self.optimizer is not None:
            self.optimizer.global_norm_hook = self.global_norm

    # -- gradient norm --------------------------------------------------------------------------------------

    def global_norm(self, local_norm: float) -> float:
        replicated = self._replicated_square()
        share = local_norm**2 - (self.size - 1) / self.size * replicated
        total = torch.tensor([share], dtype=torch.float64, device=self.device)  # NCCL needs the device
        dist.all_reduce(total, group=self.group)
        value = total.item()
        return value if math.isnan(value) or math.isinf(value) else math.sqrt(max(value, 0.0))

    def _replicated_square(self) -> float:
        wrapper = self.optimizer
        # by the mark, not a list taken at sharding: AutoEP replaces MoE blocks after it
        replicated = {
            id(p) for bucket in wrapper_buckets(wrapper) for p in bucket.params
            if getattr(p, "tp_partition", None) is None
        }  # fmt: skip
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if hasattr(wrapper, "reducer"):  # stage 0: whole averaged buckets
            for bucket in wrapper.reducer.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if id(p) in replicated:
                        total += torch.linalg.vector_norm(view.float()).double() ** 2
            return total.item()
        # stages 1-2: this rank's shard of every bucket, laid out like the flat parameters
        for bucket_index, bucket in enumerate(wrapper.buckets):
            shard = wrapper.gradient_shard(bucket_index)
            for index, _, _, start, length in bucket.fragments():
                if id(bucket.params[index]) in replicated:
                    piece = shard[start : start + length].float()
                    total += torch.linalg.vector_norm(piece).double() ** 2
        if dist.get_world_size(wrapper.group) > 1:
            dist.all_reduce(total, group=wrapper.group)
        return total.item()


def wrapper_buckets(wrapper) -> list:
    """The gradient buckets of a stage wrapper: stage 0's reducer's, or stages 1-2's flat buckets."""
    return wrapper.reducer.buckets if hasattr(wrapper, "reducer") else wrapper.buckets


def _hf_plan_specs(model):
    """A Hugging Face model's tp_plan as layer specs (None: it has none). Used when the config gives no
    `tensor_parallel.partition_config`, which, when given, wins over the model's plan as in DeepSpeed."""
    plan = hf_tp_plan(model)
    specs = TPPlanConverter.convert(plan) if plan else None
    if specs is not None:
        log_dist(
            f"AutoTP: placing layers by the model's Hugging Face tp_plan ({len(specs)} entries)", ranks=[0]
        )
    return specs


def _check_supported(config) -> None:
    zero = config.zero_optimization
    if zero.stage == 3:
        raise ConfigError(
            "zero_optimization.stage: 3 cannot be combined with tensor_parallel.autotp_size > 1 yet (stages 0-2 "
            "shard over the data axis; DeepSpeed supports the same set)"
        )
    offload = zero.offload_optimizer
    if offload is not None and offload.device != "none":
        raise ConfigError(
            "zero_optimization.offload_optimizer: optimizer offload cannot be combined with "
            "tensor_parallel.autotp_size > 1 yet"
        )


@torch.no_grad()
def _broadcast_from_first_tensor_rank(model, group) -> None:
    """Every tensor rank shards the same full model: tensor rank 0's parameters and buffers."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.device.type != "meta"]
    if not tensors:
        return
    src = dist.get_global_rank(group, 0)
    device = accelerator.device_for_local_rank(int(os.environ.get("LOCAL_RANK", "0")))  # NCCL: on the device
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same]).to(device)
        dist.broadcast(flat, src=src, group=group)
        for t, piece in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(piece.view_as(t))
