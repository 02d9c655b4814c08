"""ZeRO stage 3: parameters partitioned too; each module's parameters are gathered just before it runs.

The coordinator puts hooks on every module that roots a unit (param_units.py) and on every module that uses
a parameter owned by another unit (tied weights):
- forward pre-hook: gather the units (waiting on a prefetch if one is in flight), then prefetch the units
  that came next in the previous step's order;
- forward hook: release them, or keep them for backward when they are reused soon, and hook the outputs so
  that their backward gathers the units again;
- gradient hooks (the stage 2 reducer): once a unit's last gradient is produced its full parameters are
  released and its gradient is reduce-scattered into this rank's shard.

DeepSpeed's knobs, in elements (persistent units never count):
- `stage3_prefetch_bucket_size`: how far ahead of use units are gathered (at least the next unit);
- `stage3_max_live_parameters`: no prefetch and no keeping beyond this many gathered elements; a unit
  that must be gathered evicts units kept for backward first;
- `stage3_max_reuse_distance`: after its forward a unit stays gathered if, in the recorded order, fewer
  than this many elements are gathered before backward needs it again (twice the units after it). With
  DeepSpeed's defaults (1e9) a model under ~0.5B parameters is gathered once per step, not twice; set
  it to 0 to keep only the last unit and hold peak memory near one unit.

The order of gathers is recorded every step and only used as a hint, so a module whose execution order
changes between steps still works: a wrong guess costs an early gather, never a hang, as long as all ranks
run the same modules (the same requirement collectives always have).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from shardspeed.core.partitioned import logical_numel
from shardspeed.utils.logging import logger
from shardspeed.zero.param_units import LiveNumel, ParamUnit, UnitState, plan_units
from shardspeed.zero.parameter_dict import ensure_zero_ordered_dict


def _returned_parameters(output) -> list[torch.Tensor]:
    """Parameters a module's forward returns directly (as DeepSpeed looks for them: the output itself, the
    items of a list or tuple, the values of a dict or of an object's attributes)."""
    if isinstance(output, torch.Tensor):
        items = [output]
    elif isinstance(output, (list, tuple)):
        items = list(output)
    elif isinstance(output, dict):
        items = list(output.values())
    else:
        items = [v for k, v in getattr(output, "__dict__", {}).items() if not k.startswith("__")]
    return [t for t in items if isinstance(t, nn.Parameter)]


def _output_tensors(output) -> list[torch.Tensor]:
    """Tensors of a module's output whose backward is the module's: computed ones, not leaves (a parameter
    the module returns gets its gradient from whoever uses it)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad and output.grad_fn is not None else []
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _output_tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _output_tensors(o)]
    return []


class Stage3Coordinator:
    """Gathers and releases parameter units around each module's forward and backward."""

    def __init__(self, root: nn.Module, units: list[ParamUnit], *, prefetch_numel: int = 50_000_000,
                 max_live_numel: int = 1_000_000_000, max_reuse_distance: int = 1_000_000_000,
                 tier=None, log_order_changes: bool = False):  # fmt: skip
        self.units = units
        self.root = root
        self.log_order_changes = log_order_changes  # DeepSpeed's `log_trace_cache_warnings`
        self.steps = 0
        self.tier = tier  # parameter offload (swap/param_swapper.py), or None
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.live = units[0].live if units else LiveNumel()  # shared by all units (build_units)
        self.order: list[ParamUnit] = []  # first gathers of the previous step, in order
        self._position: dict[int, int] = {}
        self._cursor = -1  # the furthest position in `order` this forward has gathered
        self._reuse_distance: dict[int, int] = {}  # unit id -> elements gathered between forward and backward
        self._kept: list[ParamUnit] = []  # released in forward but kept gathered for their backward
        self._this_step: list[ParamUnit] = []
        self._seen: set[int] = set()
        self._handles: dict[nn.Module, list] = {}  # each hooked module's two forward-hook handles
        by_module: dict[nn.Module, list[ParamUnit]] = {}
        for unit in units:
            by_module.setdefault(unit.module, []).append(unit)
        self.owner = {id(p): unit for unit in units for p in unit.params}
        self.stack: list[nn.Module] = []  # hooked modules currently inside their forward
        self.paused = False  # unwrap_model_for_generation: everything is gathered, hooks do nothing
        self.backward_follows = True  # False for an engine without an optimizer (evaluation only)
        self._lingering: ParamUnit | None = None  # released in forward, freed at the next acquire
        self.needs: dict[nn.Module, list[ParamUnit]] = {}
        # units a module holds because an inner one returned their parameters to it
        self._handed: dict[nn.Module, set[int]] = {}
        for module, needed in self._modules_and_units(root, by_module, self.owner):
            self._hook(module, needed)
        # Modules that only contain hooked ones are on the stack too (needing nothing themselves): the caller
        # of a module that returns a parameter is known exactly, as with DeepSpeed, which hooks every module.
        for module in self._containers(root):
            self._hook(module, [])
        # Modules may read a child's parameters without calling the child (nn.MultiheadAttention reads
        # out_proj.weight): parameter look-ups go through a dict that gathers on first use in a forward
        # (parameter_dict.py); modules attached later are given one at the start of each forward.
        for module in root.modules():
            external_params_of(module)
            # DeepSpeed's method, which TRL's `remove_hooks` reads on the root: (id, parameter) pairs
            module.ds_external_parameters = types.MethodType(ds_external_parameters, module)
            ensure_zero_ordered_dict(module, self)

    def _hook(self, module: nn.Module, needed: list[ParamUnit]) -> None:
        self.needs[module] = needed
        self._attach(module)

    def _attach(self, module: nn.Module) -> None:
        self._handles[module] = [
            module.register_forward_pre_hook(self._make_pre_forward(module)),
            module.register_forward_hook(self._make_post_forward(module)),
        ]

    # -- the hooks as handles: taken off and put back by RLHF frameworks around generation ---------------------

    def hook_handles(self) -> list:
        """The forward hooks' handles still registered (calling `.remove()` on one takes its hook off)."""
        return [h for handles in self._handles.values() for h in handles if _registered(h)]

    def forget_removed_hooks(self) -> None:
        """Drop the handles whose hooks were removed (TRL's `forward_hooks = []` after removing each one).
        Forgetting a hook still registered would leave it running unseen, so that is refused."""
        live = self.hook_handles()
        if live:
            raise RuntimeError(
                f"ZeRO-3 hooks: {len(live)} forward hooks are still registered; call .remove() on each handle "
                "before clearing the list"
            )
        self._handles = {}

    def register_hooks(self, module: nn.Module) -> None:
        """Put back the hooks of every hooked module in `module`'s subtree (DeepSpeed's
        `_register_deepspeed_module`), as they were: same units, same external parameters. Parameters read
        while the hooks were off were gathered by someone else (GatheredParameters); the recorded gather
        order is dropped when the root is re-registered, so the next step records a fresh one."""
        targets = [m for m in module.modules() if m in self.needs]
        doubled = [m for m in targets if any(_registered(h) for h in self._handles.get(m, []))]
        if doubled:
            raise RuntimeError(
                f"ZeRO-3 hooks are already registered on {len(doubled)} of these modules (the first: "
                f"{type(doubled[0]).__name__}); remove them first, or they would gather twice"
            )
        for target in targets:
            self._attach(target)
        if module is self.root:
            self.invalidate_order()

    def order_is_recorded(self) -> bool:
        return bool(self.order)

    def invalidate_order(self) -> None:
        """Forget the recorded gather order (and the reuse distances taken from it): no prefetch and no
        keeping for backward until the next step has recorded a new one."""
        self.order, self._position, self._reuse_distance, self._cursor = [], {}, {}, -1

    def on_parameter_access(self, param: nn.Parameter) -> None:
        """A parameter read inside a forward whose unit nobody holds: gather it for the innermost module
        running (and from now on, gather it before that module's forward and backward)."""
        unit = self.owner.get(id(param))
        if unit is None or unit.refs > 0 or not self.stack:
            return
        module = self.stack[-1]
        self.needs[module].append(unit)
        self._acquire(unit)

    def _containers(self, root: nn.Module) -> list[nn.Module]:
        """Modules not hooked yet with a hooked module below them."""
        found = []

        def visit(module: nn.Module) -> bool:
            below = [visit(child) for child in module.children()]  # every child visited
            if any(below) and module not in self.needs:
                found.append(module)
            return module in self.needs or any(below)

        visit(root)
        return found

    @staticmethod
    def _modules_and_units(root: nn.Module, by_module, owner):
        """Unit roots need their own units; any module using a parameter of a unit that is not gathered
        around it (a tied weight) needs that unit too. The root is always hooked, even with no units of its
        own, so that a parameter its forward reads directly (`F.linear(x, self.child.weight)` after the child
        ran) has a running module to be gathered for."""
        result = []

        def visit(module: nn.Module, covering: set[int]) -> None:
            own = by_module.get(module, [])
            covering = covering | {id(u) for u in own}
            external = []
            for p in module._parameters.values():
                unit = owner.get(id(p)) if p is not None else None
                if unit is not None and id(unit) not in covering and unit not in external:
                    external.append(unit)
            if own or external or module is root:
                result.append((module, own + external))
            for child in module.children():
                visit(child, covering)

        visit(root, set())
        return result

    # -- hooks ----------------------------------------------------------------------------------------------

    def _make_pre_forward(self, module: nn.Module):
        units = self.needs[module]

        def pre_forward(module, args):
            if self.paused:
                return
            if module is self.root:  # modules attached since the last forward read parameters through one too
                for child in module.modules():
                    ensure_zero_ordered_dict(child, self)
            self.stack.append(module)
            for unit in units:
                self._acquire(unit)
            # Prefetch after the furthest point this forward has reached in the recorded order: a module that
            # uses an earlier unit again (a head tied to the embedding) must not prefetch what followed that
            # unit, which has run already and would be gathered for nothing.
            positions = [self._position[id(u)] for u in units if id(u) in self._position]
            if positions and max(positions) > self._cursor:
                self._cursor = max(positions)
                self._prefetch_from(self._cursor, step=1)

        return pre_forward

    def _make_post_forward(self, module: nn.Module):
        units = self.needs[module]

        def post_forward(module, args, output):
            if self.paused:
                return
            self.stack.pop()
            self._hand_returned_parameters_up(module, output)
            for unit in units:
                unit.refs -= 1
                if unit.idle:
                    self._release_after_forward(unit)
            if torch.is_grad_enabled() and units:
                for tensor in _output_tensors(output):
                    tensor.register_hook(self._make_pre_backward(units))
            if module is self.root:
                self._end_of_forward()

        return post_forward

    def _hand_returned_parameters_up(self, module: nn.Module, output) -> None:
        """A parameter returned from a forward (`return out, self.bias`) is used by the caller: its unit
        becomes an external unit of the innermost running module (from this step on, gathered before that
        module's forward and held until it returns), as DeepSpeed registers a returned parameter with the
        caller. A module that passes such a parameter on hands it further up. Without this the unit is
        released when the returning module ends and the caller reads an empty tensor."""
        if not self.stack:
            return
        caller = self.stack[-1]
        for param in _returned_parameters(output):
            unit = self.owner.get(id(param))
            if unit is None or any(unit in self.needs[m] for m in self.stack):
                continue
            handed = self._handed.setdefault(module, set())
            if id(unit) in handed:  # passed on again: the caller takes over this module's hold on it
                handed.discard(id(unit))
                self.needs[module].remove(unit)
                external_params_of(module).pop(id(param), None)
            else:
                unit.gather(for_training=True)
                unit.refs += 1
            self.needs[caller].append(unit)  # the caller's post-forward lets go of it with its own units
            self._handed.setdefault(caller, set()).add(id(unit))
            external_params_of(caller)[id(param)] = param

    def _end_of_forward(self) -> None:
        """Leave no gather in flight once the model's forward returns, so `ds_status` outside a forward is
        AVAILABLE (full data) or NOT_AVAILABLE, never INFLIGHT with empty data: code that gathers only the
        NOT_AVAILABLE parameters (DeepSpeed-Chat's ZeRO-3 save, EMA and LoRA fusion) would read empty tensors.

        With no backward to follow (`torch.no_grad()`, or an engine without an optimizer), every unit nothing
        holds is released, as DeepSpeed does after an eval forward; a training forward keeps what its backward
        will reuse and only finishes the prefetches it never used (released at the end of backward)."""
        self._cursor = -1
        if torch.is_grad_enabled() and self.backward_follows:
            for unit in self.units:
                if unit.state is UnitState.GATHERING and unit.refs == 0:
                    unit.wait_for_gather()
            return
        self._lingering, self._kept = None, []
        for unit in self.units:
            if unit.idle and not unit.persistent:
                unit.free()  # waits for a gather in flight first

    def _make_pre_backward(self, units: list[ParamUnit]):
        def pre_backward(grad):
            for unit in units:
                unit.gather(for_training=True)  # if released; waits on a gather in flight; else nothing
                if unit.group_index is not None:  # frozen units wait for end_of_backward instead
                    unit.expect_gradients()
            position = self._position.get(id(units[0]))
            if position is not None:
                self._prefetch_from(position, step=-1)
            return grad

        return pre_backward

    def _release_after_forward(self, unit: ParamUnit) -> None:
        """Keep the unit for its backward if it is reused soon enough, else let it linger until the next
        acquire (a unit used again right away, such as a tied embedding, then costs no gather)."""
        if unit.persistent:
            return
        distance = self._reuse_distance.get(id(unit))
        if (
            torch.is_grad_enabled()
            and self.backward_follows
            and distance is not None
            and distance <= self.max_reuse_distance
            and self.live.numel <= self.max_live_numel
        ):
            if self._lingering is unit:
                self._lingering = None
            if unit not in self._kept:
                self._kept.append(unit)
            return
        self._free_lingering(keep=unit)
        self._lingering = unit

    def _free_lingering(self, keep: ParamUnit) -> None:
        lingering, self._lingering = self._lingering, None
        if lingering is not None and lingering is not keep and lingering.idle:
            lingering.free()

    def _make_room(self, numel: int) -> None:
        """Free units kept for backward, those needed last first, until `numel` more elements fit."""
        while self._kept and self.live.numel + numel > self.max_live_numel:
            unit = self._kept.pop(0)
            if unit.idle:
                unit.free()

    def _acquire(self, unit: ParamUnit) -> None:
        self._free_lingering(keep=unit)
        if unit.state is UnitState.RELEASED and not unit.persistent:
            self._make_room(unit.padded_numel)
        unit.gather(for_training=True)
        unit.refs += 1
        if id(unit) not in self._seen:
            self._seen.add(id(unit))
            self._this_step.append(unit)

    def _read_ahead(self, position: int, step: int) -> None:
        """Parameter offload: start reading the shards of the units that come next, as far as the tier's
        buffer budget allows (reads run ahead of the gathers, which need the shards in memory)."""
        index = position + step
        while 0 <= index < len(self.order) and self.order[index].prefetch_shard():
            index += step

    def _prefetch_from(self, position: int, step: int) -> None:
        """Start gathering the units that followed (forward, step 1) or preceded (backward, step -1) the
        unit at `position` of last step's order, up to `prefetch_numel` elements ahead and within the live
        budget."""
        if self.tier is not None:
            self._read_ahead(position, step)
        if not self.prefetch_numel:
            return
        ahead = 0
        index = position + step
        while 0 <= index < len(self.order):
            upcoming = self.order[index]
            index += step
            if upcoming.persistent:
                continue
            if ahead and ahead + upcoming.padded_numel > self.prefetch_numel:
                return
            ahead += upcoming.padded_numel
            if upcoming.state is UnitState.RELEASED:
                if self.live.numel + upcoming.padded_numel > self.max_live_numel:
                    return
                upcoming.gather(async_op=True, for_training=True)

    # -- engine-facing -------------------------------------------------------------------------------------

    def on_unit_grads_staged(self, unit: ParamUnit) -> None:
        """Called by the gradient reducer once a unit's gradients are all staged for reduction."""
        unit.gradients_done()
        if unit.refs == 0 and not unit.has_frozen:
            unit.free()

    def end_of_backward(self) -> None:
        """Release everything still gathered (unused parameters, frozen ones, wrong prefetch guesses)."""
        self._lingering, self._kept, self._cursor = None, [], -1
        for unit in self.units:
            unit.gradients_done()
            if unit.refs == 0:
                unit.free()
        if self.log_order_changes and self.order and self._this_step and self._this_step != self.order:
            pairs = enumerate(zip(self.order, self._this_step))
            first = next((i for i, (a, b) in pairs if a is not b), min(len(self.order), len(self._this_step)))
            logger.warning(
                f"ZeRO-3 gather order changed at step {self.steps} (first difference at gather {first}): the "
                "prefetch order is re-recorded"
            )
        self.steps += 1
        self.order, self._this_step, self._seen = self._this_step or self.order, [], set()
        self._position = {id(u): i for i, u in enumerate(self.order)}  # pre-forward hooks look up here
        # A unit's reuse distance: the units after it are gathered once in forward and once in backward
        # before its own backward needs it again.
        after = 0
        self._reuse_distance = {}
        for unit in reversed(self.order):
            self._reuse_distance[id(unit)] = 2 * after
            after += 0 if unit.persistent else unit.padded_numel

    def after_step(self) -> None:
        for unit in self.units:
            unit.refresh()

    def release_all(self) -> None:
        """Free every gathered unit nothing holds, the persistent ones too (`engine.empty_partition_cache`,
        as DeepSpeed: afterwards no parameter holds data; the next forward gathers what it uses)."""
        self._lingering, self._kept = None, []
        for unit in self.units:
            if unit.refs == 0:
                unit.gradients_done()
                unit.free(persistent_too=True)

    def remove_hooks(self) -> None:
        for handle in self.hook_handles():
            handle.remove()
        self._handles = {}
        on_disk = 0
        for unit in self.units:
            if unit.offloaded_to_disk:
                # The model may not fit in memory at all: gathering it here could end the job. NVMe-resident
                # parameters are left empty (their files go with the engine); save them before destroy().
                on_disk += 1
                continue
            unit.persistent = True  # leave the module usable: gather everything once, for good
            unit.gather()
        if on_disk:
            logger.warning(
                f"destroy(): {on_disk} parameter units offloaded to NVMe are not gathered into the module; "
                "save_checkpoint() or save_16bit_model() before destroy() to keep their values"
            )


def external_params_of(module: nn.Module) -> dict:
    """DeepSpeed's `module._external_params`: {id: parameter} of the parameters of other modules that this
    module's forward uses and that were registered with it (`register_external_parameter`, or returned to it
    by an inner module)."""
    if not hasattr(module, "_external_params"):
        module._external_params = {}
    return module._external_params


def ds_external_parameters(module: nn.Module):
    """DeepSpeed's `module.ds_external_parameters()`, bound to each hooked model's modules: the (id, parameter)
    pairs of the other modules' parameters registered with this one."""
    return external_params_of(module).items()


def _registered(handle) -> bool:
    """Whether the hook behind a torch RemovableHandle is still registered (its `remove()` not called)."""
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def build_units(module: nn.Module, optimizer, names: dict, *, unit_numel: int, persistence_threshold: int,
                model_persistence_threshold: int, group, tier=None, owned: set[int] | None = None,
                split_by=None, allgather_sequential: bool = False,
                fetch_with_all_reduce: bool = False, weights=None) -> list[ParamUnit]:  # fmt: skip
    """One ParamUnit per (unit root, optimizer group, value of `split_by(param)` such as the communication
    dtype); parameters outside every group form frozen units.

    A unit of at most `persistence_threshold` elements stays gathered, while the persistent units' total
    stays within `model_persistence_threshold` (DeepSpeed's `stage3_model_persistence_threshold`).
    `weights`: ZeRO++'s gather paths (zeropp/weights.py), or None.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    units = []
    live = LiveNumel()
    persistent_numel = 0
    for root, params in plan_units(module, unit_numel):
        by_group: dict = {}
        for p in params:
            if owned is not None and id(p) not in owned:
                continue  # another wrapper's parameter (MoE: experts are partitioned in their own group)
            gi = group_of.get(id(p)) if p.requires_grad else None
            by_group.setdefault((gi, split_by(p) if split_by is not None else None), []).append(p)
        for (gi, _), members in by_group.items():
            numel = sum(logical_numel(p) for p in members)
            persistent = (
                numel <= persistence_threshold and persistent_numel + numel <= model_persistence_threshold
            )
            persistent_numel += numel if persistent else 0
            unit_names = [names[p] for p in members]
            unit = ParamUnit(
                root, members, unit_names, gi, world, rank, group, persistent, live, tier, weights
            )
            unit.allgather_sequential, unit.fetch_with_all_reduce = (
                allgather_sequential,
                fetch_with_all_reduce,
            )
            units.append(unit)
    return units
