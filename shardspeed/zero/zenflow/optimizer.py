"""`ZenFlowZeroOptimizer`: ZeRO 1-2 with optimizer offload, where the important columns never wait.

Plain ZeRO-Offload steps every element on the host at every step, and the device waits for it. ZenFlow
(`zero_optimization.zenflow`) instead, at every step after the warm-up rounds:

1. takes the step's averaged gradient (unscaled and clipped once, for both paths below);
2. at a selection step (schedule.py), picks each 2-D parameter's top `topk_ratio` columns by gradient L1
   norm (columns.py), writes the previous selection's device values into the fp32 masters and clears the
   selective moments;
3. updates the selected columns — and every 1-D parameter whole — on the device, with the selective AdamW
   (ops/zenflow_adam.py), from this step's gradient;
4. adds the gradient shard to a host accumulator; when the schedule says so, the offloaded optimizer steps
   the masters with the *mean* accumulated gradient, the shards are all-gathered as in any ZeRO step, and
   the selected columns get back their device values (the host result for them is discarded: the device
   owns them until the next selection).

With `topk_ratio` 1 every column is selected, so every step is a plain AdamW step on the device. The
warm-up steps, the overflow skip and the loss scaler are ZeroOptimizer's. Its state (schedule, selection,
selective moments, accumulator) is its own, saved per rank by `ZenFlowState` (part.py).
"""

from __future__ import annotations

import torch

from shardspeed.config import ConfigError
from shardspeed.config.zero import ZenFlowConfig
from shardspeed.ops.zenflow_adam import ZenFlowSelectiveAdamW
from shardspeed.zero.optimizer import ZeroOptimizer
from shardspeed.zero.zenflow.columns import (
    column_norms,
    column_params,
    selected_gradients,
    shard_positions,
    top_columns,
)
from shardspeed.zero.zenflow.schedule import ZenFlowSchedule

__all__ = ["ZenFlowZeroOptimizer"]

_HYPER = ("lr", "betas", "eps", "weight_decay")


class ZenFlowZeroOptimizer(ZeroOptimizer):
    """The stage 1/2 wrapper with ZenFlow's step; everything else (backward, checkpoints of the masters and
    the host optimizer, accessors) is ZeroOptimizer's."""

    def __init__(self, *args, zenflow: ZenFlowConfig, loader_steps_per_epoch: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule = ZenFlowSchedule.from_config(zenflow, loader_steps_per_epoch)
        self.topk_ratio = zenflow.topk_ratio
        self.columns = column_params(self.buckets)
        self._by_name = {b.names[i]: b.params[i] for b in self.buckets for i in range(len(b.params))}
        self.selection: dict[str, torch.Tensor] = {}
        missing = [k for k in _HYPER if k not in self.optimizer.param_groups[0]]
        if missing:  # the selective step is AdamW with the optimizer's own hyperparameters
            raise ConfigError(
                f"zero_optimization.zenflow: needs an Adam-family optimizer (its selective step is AdamW with the "
                f"optimizer's {', '.join(_HYPER)}), got {type(self.optimizer).__name__}"
            )
        groups = []
        for group, params in zip(self.optimizer.param_groups, self.model_param_groups):
            groups.append(
                {"params": params, **{k: group[k] for k in _HYPER}, "amsgrad": group.get("amsgrad", False)}
            )
        self.selective = ZenFlowSelectiveAdamW(groups, offload=zenflow.offload)
        host = self.offload.host
        self.accumulated = [
            torch.zeros(b.shard_numel, dtype=torch.float32, device=host) for b in self.buckets
        ]

    # -- the step ---------------------------------------------------------------------------------------------

    def step(self) -> bool:
        if self.schedule.in_warm_up():
            applied = super().step()
            if applied:
                self.schedule.finish_step(updated=True)
            return applied
        multiplier = self._step_multiplier()
        if multiplier is None:
            return False
        shards = [g * multiplier for g in self.grads.flat_grads()]
        for total, grad in zip(self.accumulated, self.host_grads.take()):
            total.add_(grad.to(total.device, torch.float32), alpha=multiplier)
        self._select_and_observe(shards)
        self._selective_step(shards)
        updated = self.schedule.updates_now()
        if updated:
            self._host_update()
        self.schedule.finish_step(updated)
        self.scaler.update(False)
        self.zero_grad()
        return True

    def _select_and_observe(self, shards: list[torch.Tensor]) -> None:
        selecting, auto = self.schedule.selects_now(), self.schedule.auto
        if not selecting and auto is None:
            return
        norms = column_norms(self.columns, self.buckets, shards, self.group)
        if selecting:
            if self.selection:
                self._masters_take_device_columns()
            self.selective.clear_selected_mv()
            self.selection = top_columns(norms, self.topk_ratio, self.group)
        if auto is not None:
            for name, sums in norms.items():
                chosen = self.selection[name].to(sums.device)
                selected = sums[chosen].sum().item()
                unselected = sums.sum().item() - selected
                auto.observe(
                    name, selected / chosen.numel(), unselected / max(1, sums.numel() - chosen.numel())
                )

    def _selective_step(self, shards: list[torch.Tensor]) -> None:
        grads = selected_gradients(self.columns, self.buckets, shards, self.selection, self.group)
        for column in self.columns:
            param = self._by_name[column.name]
            param.selected_indices = self.selection.get(column.name)
            param.selected_grad = grads[column.name]
        for mine, group in zip(self.selective.param_groups, self.optimizer.param_groups):
            mine.update({k: group[k] for k in _HYPER})  # the LR schedule drives both optimizers
        self.selective.step()

    def _host_update(self) -> None:
        """The offloaded optimizer's step with the mean accumulated gradient; the device keeps its columns."""
        kept = {name: self._device_part(name).clone() for name in self._by_name}
        count = self.schedule.accumulated + 1
        self.host_grads.grads = [total / count for total in self.accumulated]
        self._apply(1.0)  # steps the masters, writes the shards, all-gathers them
        for name, value in kept.items():
            self._set_device_part(name, value)
        for total in self.accumulated:
            total.zero_()

    def _device_part(self, name: str) -> torch.Tensor:
        param = self._by_name[name]
        return param.data[:, self.selection[name]] if name in self.selection else param.data

    def _set_device_part(self, name: str, value: torch.Tensor) -> None:
        param = self._by_name[name]
        if name in self.selection:
            param.data[:, self.selection[name]] = value
        else:
            param.data.copy_(value)

    @torch.no_grad()
    def _masters_take_device_columns(self) -> None:
        """Before a new selection: the fp32 masters take the device's values of the columns the device owned
        (only those, so the other columns keep their fp32 precision)."""
        for index, (bucket, master) in enumerate(zip(self.buckets, self.masters)):
            if master is bucket.shard:
                continue  # fp32 training on the host: the master is the shard itself
            where = shard_positions(self.columns, index, bucket, self.selection)
            master[where.to(master.device)] = bucket.shard[where.to(bucket.shard.device)].to(
                master.device, master.dtype
            )

    # -- its own state (saved per rank by part.py) --------------------------------------------------------------

    def zenflow_state_dict(self) -> dict:
        moments = {}
        for name, param in self._by_name.items():
            state = self.selective.state.get(param)
            if state:
                moments[name] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        return {
            "schedule": self.schedule.state_dict(),
            "selection": {name: idx.cpu() for name, idx in self.selection.items()},
            "selective_moments": moments,
            "accumulated": [t.clone() for t in self.accumulated],
        }

    def start_afresh(self) -> None:
        """Forget the selection, the selective moments and the accumulator: the next step selects anew (a
        load without this rank's ZenFlow file)."""
        self.schedule.restart()
        self.selection = {}
        self.selective.state.clear()
        for total in self.accumulated:
            total.zero_()

    def load_zenflow_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])
        device = self.buckets[0].device if self.buckets else torch.device("cpu")
        self.selection = {name: idx.to(device) for name, idx in state["selection"].items()}
        self.selective.state.clear()
        for name, saved in state["selective_moments"].items():
            param = self._by_name[name]
            home = torch.device("cpu") if self.selective.offload else param.device
            loaded = {k: v.to(home) if torch.is_tensor(v) and k != "step" else v for k, v in saved.items()}
            self.selective.state[param] = loaded
            if self.selective.offload:
                param.exp_avg_cpu_data, param.exp_avg_sq_cpu_data = loaded["exp_avg"], loaded["exp_avg_sq"]
        for total, saved in zip(self.accumulated, state["accumulated"]):
            total.copy_(saved)
