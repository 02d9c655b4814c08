"""ZenFlow's selective AdamW: an AdamW step on the *selected columns* of each parameter only.

ZenFlow (`zero_optimization.zenflow`) splits every 2-D parameter's columns in two: the few most important
ones (top-k by gradient magnitude) are updated on the device at every step by this optimizer, the rest by the
offloaded optimizer every `update_interval` steps. DeepSpeed's classes carry the selection on the parameters
themselves, and so do these (same attributes, so code written against DeepSpeed's drives them unchanged):

- `param.selected_indices`: the selected column numbers (a 1-D integer tensor; ignored for 1-D parameters,
  which are always updated whole);
- `param.selected_grad`: the gradient of those columns, shaped as `param[:, selected_indices]` (stage 3:
  as the selected rows of the transposed partition, see below); consumed (set to None) by the step;
- `param.temp_selected_param`: optional snapshot of the selected columns taken before another optimizer
  wrote the parameter (`temp_copy_param`); the step starts from it, then drops it.

The update itself is torch's AdamW (`torch.optim.adam.adam` with decoupled weight decay, the kernel
`torch.optim.AdamW` runs), on an fp32 working copy of the selected slice: the moments are fp32 even for
16-bit parameters (DeepSpeed keeps them in the parameter's dtype), and the result is cast back once.

`offload=True` keeps the moments in host memory between steps (`param.exp_avg_cpu_data`,
`param.exp_avg_sq_cpu_data`, as DeepSpeed names them) and brings them to the parameter's device for the update,
`bucket_size` elements at a time. On a CPU-only run host and device are the same memory.

`ZenFlowCPUAdam` is the host side: DeepSpeed's CPU Adam stepped by the caller's step number
(`step(step_id)`: bias correction uses `step_id`, however many steps this optimizer has taken), because the
host optimizer of ZenFlow steps only every `update_interval` steps but counts in training steps.

`ZenFlowSelectiveAdamW_stage3` does the same on a ZeRO-3 partition (`param.ds_tensor`), which DeepSpeed
stores transposed: `ds_shape` is (columns, rows), the parameter's columns are the partition's rows, and
`complete_column_offset` / `complete_numel` locate the whole columns inside the partition. A partition
swapped out to NVMe (`ds_tensor.data` a 0-d placeholder, `param.nvme_swapper` set) is swapped in around the
update and written back after it; a read-only snapshot releases it without writing back.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _functional_adam

from shardspeed.ops.adam import DeepSpeedCPUAdam

__all__ = ["ZenFlowCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]


def _selected(param) -> bool:
    return getattr(param, "selected_grad", None) is not None


class _SelectiveAdamBase(torch.optim.AdamW):
    """What both layouts share: the step variants, the moment placement and the AdamW update itself.
    Subclasses say how to read and write a parameter's selected slice (`_read_selected`, `_write_selected`)."""

    def __init__(self, params, *args, offload: bool = False, bucket_size: float = 5e8, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.offload = offload
        self.bucket_size = int(bucket_size)
        # DeepSpeed binds `step` to the variant at construction (its tests check which one).
        self.step = self._step_with_offload if offload else self._step_without_offload

    # -- the selected slice: per layout ---------------------------------------------------------------------

    def _read_selected(self, param) -> torch.Tensor:
        raise NotImplementedError

    def _write_selected(self, param, value: torch.Tensor) -> None:
        raise NotImplementedError

    # -- public API (DeepSpeed's names) ------------------------------------------------------------------------

    @torch.no_grad()
    def clear_selected_mv(self) -> None:
        """Zero the moments of every parameter (the selection changed: old columns' moments do not apply)."""
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if state:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()
                    if "max_exp_avg_sq" in state:
                        state["max_exp_avg_sq"].zero_()

    @torch.no_grad()
    def _step_without_offload(self) -> None:
        for index in range(len(self.param_groups)):
            self._update(index, [p for p in self.param_groups[index]["params"] if _selected(p)], restore=True)

    @torch.no_grad()
    def _step_with_offload(self) -> None:
        """As without offload, `bucket_size` elements at a time, so at most that much moment state is on the
        device at once."""
        for index, group in enumerate(self.param_groups):
            bucket, numel = [], 0
            for param in (p for p in group["params"] if _selected(p)):
                bucket.append(param)
                numel += param.selected_grad.numel()
                if numel >= self.bucket_size:
                    self._update(index, bucket, restore=True)
                    bucket, numel = [], 0
            if bucket:
                self._update(index, bucket, restore=True)

    # -- the update ---------------------------------------------------------------------------------------------

    def _update(self, group_index: int, params: list, *, restore: bool) -> None:
        """One AdamW step of `params` (all in group `group_index`) on their selected slices. `restore`: start
        from `temp_selected_param` where one was taken."""
        if not params:
            return
        group = self.param_groups[group_index]
        slices, grads, avgs, sqs, maxs, steps = [], [], [], [], [], []
        for param in params:
            snapshot = getattr(param, "temp_selected_param", None)
            current = snapshot if restore and snapshot is not None else self._read_selected(param)
            work = current.to(device=param.selected_grad.device, dtype=torch.float32, copy=True)
            state = self._state_for(param, work, group)
            slices.append(work)
            grads.append(param.selected_grad.to(work.device, torch.float32).reshape(work.shape))
            avgs.append(state["exp_avg"].to(work.device).view_as(work))
            sqs.append(state["exp_avg_sq"].to(work.device).view_as(work))
            if group["amsgrad"]:
                maxs.append(state["max_exp_avg_sq"].to(work.device).view_as(work))
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        _functional_adam(
            slices, grads, avgs, sqs, maxs, steps, foreach=False, decoupled_weight_decay=True,
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group.get("maximize", False),
        )  # fmt: skip
        for param, work, avg, sq in zip(params, slices, avgs, sqs):
            state = self.state[param]
            if state["exp_avg"].data_ptr() != avg.data_ptr():  # offloaded: the device copy goes home
                state["exp_avg"].copy_(avg.view_as(state["exp_avg"]))
                state["exp_avg_sq"].copy_(sq.view_as(state["exp_avg_sq"]))
            self._write_selected(param, work)
            param.temp_selected_param = None
            param.selected_grad = None

    def _state_for(self, param, work: torch.Tensor, group: dict) -> dict:
        """The parameter's moments (fp32, shaped as its selected slice): on the device, or with `offload` in
        host memory, where `param.exp_avg_cpu_data` / `exp_avg_sq_cpu_data` are the same tensors (adopted when
        the caller made them first, as DeepSpeed's engine does)."""
        state = self.state.setdefault(param, {})
        if "exp_avg" not in state:
            home = torch.device("cpu") if self.offload else work.device
            for key, attr in (("exp_avg", "exp_avg_cpu_data"), ("exp_avg_sq", "exp_avg_sq_cpu_data")):
                given = getattr(param, attr, None) if self.offload else None
                if given is None or given.numel() != work.numel():
                    given = torch.zeros(work.shape, dtype=torch.float32, device=home)
                state[key] = given
                if self.offload:
                    setattr(param, attr, given)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros(work.shape, dtype=torch.float32, device=home)
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        return state


class ZenFlowSelectiveAdamW(_SelectiveAdamBase):
    """Selective AdamW on whole parameters (ZeRO 1-2 keep them whole on every rank): the selected columns
    are `param[:, selected_indices]`; a 1-D parameter is updated whole."""

    def _read_selected(self, param) -> torch.Tensor:
        return param.data[:, param.selected_indices] if param.dim() != 1 else param.data

    def _write_selected(self, param, value: torch.Tensor) -> None:
        value = value.to(param.device, param.dtype)
        if param.dim() != 1:
            param.data[:, param.selected_indices] = value
        else:
            param.data.copy_(value)

    @torch.no_grad()
    def temp_copy_param(self, group_to_paramlist: dict) -> None:
        """Snapshot the selected columns of `{group index: [params]}` (on the host with `offload`), so a later
        step starts from them even if another optimizer writes the parameters in between."""
        for params in group_to_paramlist.values():
            for param in (p for p in params if _selected(p)):
                snapshot = self._read_selected(param).clone()
                param.temp_selected_param = snapshot.cpu() if self.offload else snapshot

    @torch.no_grad()
    def group_step(self, group_to_paramlist: dict) -> None:
        """Step only the given parameters, `{group index: [params]}`, from their current values."""
        for group_index, params in group_to_paramlist.items():
            self._update(group_index, [p for p in params if _selected(p)], restore=False)


class ZenFlowSelectiveAdamW_stage3(_SelectiveAdamBase):  # DeepSpeed's name
    """Selective AdamW on ZeRO-3 partitions (`param.ds_tensor`, stored transposed: the selected columns of the
    parameter are rows of the partition's 2-D view)."""

    @staticmethod
    def _rows(param) -> torch.Tensor | None:
        """The partition's whole columns as a (columns, rows) view, or None for a 1-D parameter."""
        shape = param.ds_shape
        if len(shape) == 1:
            return None
        row_numel = shape[1]
        whole = param.ds_tensor.data.narrow(0, param.complete_column_offset, param.complete_numel)
        return whole.view(param.complete_numel // row_numel, row_numel)

    def _read_selected(self, param) -> torch.Tensor:
        rows = self._rows(param)
        if rows is None:
            return param.ds_tensor.data
        return rows[param.selected_indices.to(rows.device), :]

    def _write_selected(self, param, value: torch.Tensor) -> None:
        rows = self._rows(param)
        target = param.ds_tensor.data if rows is None else rows
        value = value.to(target.device, target.dtype)
        if rows is None:
            target.copy_(value.view_as(target))
        else:
            rows[param.selected_indices.to(rows.device), :] = value

    # -- NVMe-offloaded partitions: resident only around their own update ---------------------------------------

    @staticmethod
    def _swap_in(param) -> bool:
        """Bring an NVMe-offloaded partition into memory; True when this call did (and so owns the release)."""
        swapper = getattr(param, "nvme_swapper", None)
        if param.ds_tensor.data.dim() == 0 and swapper is not None:
            swapper.swap_in([param], async_op=False)
            return True
        return False

    def _update(self, group_index: int, params: list, *, restore: bool) -> None:
        # One partition at a time through memory when any is on NVMe, so the swap buffers are never exhausted.
        if not any(p.ds_tensor.data.dim() == 0 for p in params):
            super()._update(group_index, params, restore=restore)
            return
        for param in params:
            swapped = self._swap_in(param)
            super()._update(group_index, [param], restore=restore)
            if swapped:
                param.nvme_swapper.swap_out_and_release([param])

    @torch.no_grad()
    def temp_copy_param(self, paramlist: list) -> None:
        """Snapshot the selected rows of each partition in `paramlist` (an NVMe one is read, then released
        without writing back: it did not change)."""
        for param in (p for p in paramlist if _selected(p)):
            swapped = self._swap_in(param)
            snapshot = self._read_selected(param).clone()
            param.temp_selected_param = snapshot.cpu() if self.offload else snapshot
            if swapped:
                param.nvme_swapper.remove_partition_and_release_buffers([param])

    @torch.no_grad()
    def group_step(self, paramlist: list) -> None:
        """Step the given partitions from their current values, grouped by `param.group_id`."""
        by_group: dict[int, list] = {}
        for param in (p for p in paramlist if _selected(p)):
            by_group.setdefault(param.group_id, []).append(param)
        for group_index in sorted(by_group):
            self._update(group_index, by_group[group_index], restore=False)


class ZenFlowCPUAdam(DeepSpeedCPUAdam):
    """DeepSpeedCPUAdam whose `step(step_id)` takes the step number to use for bias correction.

    `overlap_step=True` is DeepSpeed's overlapped variant, in which a separate optimizer process drives the
    update; that variant is not built, so it is refused."""

    def __init__(self, *args, overlap_step: bool = False, **kwargs):
        if overlap_step:
            raise ValueError(
                "ZenFlowCPUAdam(overlap_step=True): ZenFlow's overlapped optimizer process is not built in "
                "shardspeed; use overlap_step=False (the step runs in the caller)"
            )
        super().__init__(*args, **kwargs)
        self.overlap_step = overlap_step
        self.step = self._sequential_step

    @torch.no_grad()
    def _sequential_step(self, step_id: int, closure=None):
        """One Adam step of every CPU parameter with a gradient, as step number `step_id` (1-based)."""
        for group in self.param_groups:
            for param in (p for p in group["params"] if p.grad is not None):
                if param.device.type != "cpu":
                    raise ValueError(
                        f"ZenFlowCPUAdam: a parameter is on {param.device}; it steps CPU parameters only "
                        "(zero_optimization.offload_optimizer.device 'cpu')"
                    )
                state = self.state[param]
                if not state:
                    dtype = torch.float32 if self.fp32_optimizer_states else param.dtype
                    state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
                state["step"] = torch.tensor(float(step_id - 1), dtype=torch.float32)  # the step adds one
        return DeepSpeedCPUAdam.step(self, closure)
