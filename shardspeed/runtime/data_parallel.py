"""ZeRO stage 0: plain data parallelism, with fp32 master weights when training in fp16/bf16.

Every rank holds the full parameters, gradients and optimizer state. Gradients are averaged by
`BucketedAllReducer` during backward; at the accumulation boundary `step()` checks for fp16 overflow,
computes the global gradient norm, folds loss-unscaling and clipping into one multiplier, steps the wrapped
torch optimizer, and copies the fp32 masters back into the module's low-precision parameters.

After the all-reduce every rank holds identical gradients, so the overflow flag and the norm are computed
locally and agree everywhere without another collective.
"""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.core.grad_buckets import BucketedAllReducer
from shardspeed.core.optimizer_wrapper import OptimizerWrapper
from shardspeed.core.placement import place_optimizer_state
from shardspeed.core.precision import LossScaler, PrecisionPlan


class DataParallelOptimizer(OptimizerWrapper):
    """Wraps a torch optimizer for stage 0. `engine.optimizer` is this object; `.optimizer` is the torch one."""

    zero_stage = 0

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        plan: PrecisionPlan,
        scaler: LossScaler,
        gradient_clipping: float,
        reducer: BucketedAllReducer,
    ):
        self.optimizer = optimizer
        self.plan = plan
        self.scaler = scaler
        self.clip = gradient_clipping
        self.reducer = reducer
        self.names = {p: name for name, p in named_params}
        self.overflow = False
        self.grad_norm: float | None = None
        # Mixed precision: fp32 masters, one flat buffer per gradient bucket, so unscaling, the optimizer's
        # foreach kernels and the copy back into the module each touch a few large tensors.
        self.master_flats: list[torch.Tensor] = []
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        if plan.mixed:
            self._create_masters()
        for _, p in named_params:
            p._shardspeed_zero = (self, None)  # found by the zero.safe_get_* accessors
        # param -> (bucket, slot); the view itself is read at call time (offload_states may move a buffer)
        self._gradient_slots = {p: (b, i) for b in reducer.buckets for i, p in enumerate(b.params)}

    # -- set-up --------------------------------------------------------------------------------------------

    def _create_masters(self) -> None:
        for bucket in self.reducer.buckets:
            flat = torch.cat([p.detach().reshape(-1).float() for p in bucket.params])
            self.master_flats.append(flat)
            offset = 0
            for p in bucket.params:
                self.masters[p] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        for group in self.optimizer.param_groups:
            group["params"] = [self.masters.get(p, p) for p in group["params"]]

    # -- the optimizer protocol the engine drives ---------------------------------------------------------

    def backward_begin(self, is_boundary: bool) -> None:
        self.reducer.sync_enabled = is_boundary

    def backward_end(self) -> None:
        self.reducer.finish()

    def _global_norm(self) -> float:
        """L2 norm of the (still scaled) averaged gradients; inf or nan when fp16 overflowed."""
        flats = self.reducer.flat_grads()
        if not flats:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(f, dtype=torch.float32) for f in flats])
        return torch.linalg.vector_norm(norms).item()  # one device sync per step, as DeepSpeed

    def _apply(self, multiplier: float) -> None:
        if self.plan.mixed:
            self._step_masters(multiplier)
        else:
            self._step_in_place(multiplier)

    def _step_in_place(self, multiplier: float) -> None:
        flats = self.reducer.flat_grads()
        if multiplier != 1.0:
            torch._foreach_mul_(flats, multiplier)
        if not self.reducer.grads_are_views:  # fp32 parameters accumulating in another dtype
            for bucket in self.reducer.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view.to(p.dtype)
        self.optimizer.step()

    def _step_masters(self, multiplier: float) -> None:
        for bucket in self.reducer.buckets:
            # fp32 accumulation buffers are used as the master gradients directly (zeroed after the step).
            grad_flat = bucket.buffer.float() if bucket.buffer.dtype != torch.float32 else bucket.buffer
            if multiplier != 1.0:
                grad_flat.mul_(multiplier)
            offset = 0
            for p in bucket.params:
                self.masters[p].grad = grad_flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self.optimizer.step()
        for bucket in self.reducer.buckets:
            torch._foreach_copy_([p.data for p in bucket.params], [self.masters[p] for p in bucket.params])
            for p in bucket.params:
                self.masters[p].grad = None

    def gradient_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """`param`'s gradient as the step will use it: its slice of the bucket buffer (where a 16-bit
        parameter's fp32 gradient accumulates, `param.grad` staying None), else `param.grad`."""
        slot = self._gradient_slots.get(param)
        return slot[0].views[slot[1]] if slot is not None else param.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # gradients live in persistent buckets; zeroing them is the equivalent
        self.reducer.zero()

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()

    # -- state ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # Name every parameter index of the torch state dict, so a checkpoint can be read by name (resharding).
        master_names = {id(m): self.names[p] for p, m in self.masters.items()}
        master_names.update({id(p): n for p, n in self.names.items()})
        state = {
            "zero_stage": 0,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "param_names": [
                [master_names.get(id(p)) for p in g["params"]] for g in self.optimizer.param_groups
            ],
            "loss_scaler": self.scaler.state_dict(),
        }
        if self.plan.mixed:
            state["fp32_master_weights"] = {self.names[p]: m for p, m in self.masters.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        self.scaler.load_state_dict(state["loss_scaler"])
        if self.plan.mixed:
            saved = state.get("fp32_master_weights")
            if saved is None:
                self.refresh_masters_from_module()
                return
            for p, master in self.masters.items():
                name = self.names[p]
                if name not in saved:
                    raise KeyError(f"checkpoint has no fp32 master weight for parameter {name!r}")
                master.copy_(saved[name])

    def refresh_masters_from_module(self) -> None:
        """Reset fp32 masters from the module's (possibly just loaded) low-precision parameters."""
        for p, master in self.masters.items():
            master.copy_(p.detach())

    @torch.no_grad()
    def load_universal(self, reader, load_optimizer_states: bool = True) -> set[str]:
        """Restore from a checkpoint of any ZeRO stage and world size, read by name (`CheckpointReader`).

        Sets every managed parameter and its fp32 master from the saved fp32 value; with
        `load_optimizer_states`, also each parameter's optimizer state, the groups' hyper-parameters and the
        fp16 loss scale. Returns the names restored (the engine restores the other parameters).
        """
        for p, name in self.names.items():
            value = reader.fp32(name)
            if p in self.masters:
                self.masters[p].copy_(value)
            p.data.copy_(value)
        if load_optimizer_states and reader.has_optimizer_state:
            self._load_universal_state(reader)
        return set(self.names.values())

    def _load_universal_state(self, reader) -> None:
        from shardspeed.checkpoint.universal import load_group_hyperparameters, restore_loss_scaler

        name_of = {id(self.masters.get(p, p)): name for p, name in self.names.items()}
        group_of = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for tensor in group["params"]:
                name = name_of.get(id(tensor))
                if name is None:
                    continue
                group_of[name] = gi
                saved = reader.optimizer_state(name)
                if saved:
                    self.optimizer.state[tensor] = place_optimizer_state(saved, tensor, group)
                else:
                    self.optimizer.state.pop(tensor, None)
        load_group_hyperparameters(reader, self.optimizer.param_groups, group_of)
        restore_loss_scaler(reader, self.scaler)
