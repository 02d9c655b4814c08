"""ZeRO stage 3 parameter units: which parameters are gathered together, and their gather/release lifecycle.

A *unit* is the parameters of one module subtree (at most about `unit_numel` elements, or a large module's
own direct parameters) packed as a `FlatParamBucket`. Between uses a unit keeps only this rank's shard; its
parameters' `.data` are empty tensors. The coordinator (stage3.py) gathers a unit just before the forward
or backward of the module that owns it and releases it afterwards.

[Note: stage 3 lifecycle] A unit's data is in one of three states (`UnitState`, `unit.state`), and each
parameter's DeepSpeed `ds_status` is derived from it in one place (`ParamUnit._enter`):

    state      what is true of the data                             ds_status      params' .data
    RELEASED   only this rank's shard; full buffer of zero bytes    NOT_AVAILABLE  empty
    GATHERING  a gather is in flight into the full buffer           INFLIGHT       empty (or the old values)
    GATHERED   the full buffer holds every rank's values            AVAILABLE      views of the buffer

    RELEASED  --gather()-------------> GATHERING   (charges `live` unless persistent)
    GATHERING --wait_for_gather()----> GATHERED    (binds the parameters)
    GATHERED  --gather() (exact values wanted) / refresh() (persistent)--> GATHERING   (refilled in place)
    GATHERED  --free()---------------> RELEASED    (storage to zero bytes; discharges `live`)

Anything else (releasing a buffer a collective is still writing, launching a second gather into it,
finishing a gather that never started) raises `UnitStateError` naming the unit and both states.
`unit.values` says what a gather brought (`Values.EXACT`, or `QUANTIZED` from ZeRO++'s qwZ / a secondary
copy of such values). Separately, `unit.awaiting` (`Awaiting`) says what the step still expects: once a
backward through a trainable unit begins it is `GRADIENTS` until every trainable gradient is staged (or
the backward ends); `refs` counts who holds it now (module forwards, nested or external uses,
`GatheredParameters`). A unit is *idle* — free to release — when `refs == 0` and it awaits nothing;
persistent units (small ones, as DeepSpeed's `stage3_param_persistence_threshold`) are released only by
`engine.empty_partition_cache` (and gathered again at their next use).
Its full parameters are released in backward as soon as every trainable parameter's gradient has been
produced — autograd accumulates a leaf's gradient only after every operation that used it has run its
backward, so nothing later needs the values.

With an offload home (parameter offload, int8 frozen weights) the shard also has a state (`ShardCopy`):
AT_HOME (not in memory) --load--> IN_MEMORY --written--> MODIFIED, and eviction stores a MODIFIED shard
before dropping it (an IN_MEMORY one is just dropped).

[Note: one storage per unit] A unit's full buffer is one tensor for its whole life; releasing it resizes
its storage to zero bytes and gathering resizes it back and fills it (as FSDP2 does). Autograd saves views
of parameters for backward (`F.linear` saves `weight.t()`), and a saved view keeps its storage alive: were
each gather a fresh buffer, every unit's forward buffer would stay in memory until its backward — the
whole model at once at the end of forward. With one storage, releasing really frees the memory, and the
re-gather before backward refills the very storage the saved views read.

[Note: how a unit is gathered] One all-gather of the shards into the full buffer, by default. DeepSpeed's
`stage3_use_all_reduce_for_fetch_params` makes it one all-reduce instead (each rank writes its shard into a
zeroed buffer; the sum is every shard in place), and `stage3_allgather_sequential` one collective per
parameter (an all-reduce of that parameter's range, so no collective ever spans two parameters). All three
give the same values bit for bit (a sum of one value and zeros is that value).

ZeRO++ (zero/zeropp/weights.py) changes how a gather for forward or backward fills the buffer — int8
records (qwZ), a node-local secondary shard (hpZ) — while gathers that must be exact stay plain:
see [Note: ZeRO++ gathers].
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from shardspeed.comm.collectives import _Works, all_gather_flat, all_reduce
from shardspeed.core.flat_params import FlatParamBucket, _moved
from shardspeed.core.partitioned import ZeroParamStatus, logical_numel, mark_zero_param


class UnitState(enum.Enum):
    """What is true of a unit's full data: see [Note: stage 3 lifecycle]."""

    RELEASED = "released"  # only this rank's shard exists; the full buffer has a storage of zero bytes
    GATHERING = "gathering"  # a gather is in flight into the full buffer: its values are not there yet
    GATHERED = "gathered"  # the full buffer holds every rank's values; the parameters are views of it


class Values(enum.Enum):
    """What a unit's gathered buffer (or its hpZ secondary shard) holds."""

    EXACT = "exact"  # every rank's shard, bit for bit
    QUANTIZED = "quantized"  # dequantized int8 records (ZeRO++ qwZ), or a secondary copy of such values


class Awaiting(enum.Enum):
    """What the training step still expects of a unit."""

    NOTHING = "nothing"
    GRADIENTS = "gradients"  # its backward has begun: the full values stay until its gradients are staged


class ShardCopy(enum.Enum):
    """Where this rank's shard is, for a unit with an offload home (always IN_MEMORY without one)."""

    AT_HOME = "at home"  # only in its home (a file, a host buffer, int8 records): loaded when needed
    IN_MEMORY = "in memory"  # in memory, the same as its home copy: eviction just drops it
    MODIFIED = "modified"  # in memory and possibly written since loaded: eviction stores it first


class UnitStateError(RuntimeError):
    """A parameter unit was asked for a transition its state does not allow (a bug in the caller)."""


_NEXT = {  # the legal transitions of UnitState
    UnitState.RELEASED: (UnitState.GATHERING,),
    UnitState.GATHERING: (UnitState.GATHERED,),
    UnitState.GATHERED: (UnitState.GATHERING, UnitState.RELEASED),
}
_DS_STATUS = {
    UnitState.RELEASED: ZeroParamStatus.NOT_AVAILABLE,
    UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
    UnitState.GATHERED: ZeroParamStatus.AVAILABLE,
}


class LiveNumel:
    """Elements of non-persistent units gathered right now, across all units (`stage3_max_live_parameters`)."""

    def __init__(self) -> None:
        self.numel = 0


class ParamUnit(FlatParamBucket):
    """A flat bucket whose full buffer exists only while gathered; the shard has its own storage."""

    def __init__(self, module: nn.Module, params, names, group_index, world, rank, group, persistent: bool,
                 live: LiveNumel | None = None, tier=None, weights=None):  # fmt: skip
        self._state = UnitState.GATHERED  # the base class packs the full values and binds the parameters
        super().__init__(params, names, group_index, world, rank)
        self.live = live if live is not None else LiveNumel()
        self.module = module
        self.group = group
        self.persistent = persistent
        self.has_frozen = any(not p.requires_grad for p in params)
        self._shard = self.flat[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone()
        self._shard_copy = ShardCopy.IN_MEMORY
        self.refs = 0  # who holds the unit now: module forwards (nested), GatheredParameters, exports
        self.awaiting = Awaiting.NOTHING
        self.on_modified = None  # set by the optimizer wrapper: refresh its fp32 master from the shard
        self.weights = weights  # ZeRO++'s gather paths (WeightGather), or None: plain all-gathers only
        self.values: Values | None = Values.EXACT  # what the full buffer holds (None while released)
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's slice of the full parameters
        self.secondary_values: Values | None = None  # what `secondary` holds
        for p, shape in zip(params, self.shapes):
            p._shardspeed_unit = self  # found by zero.GatheredParameters
            # DeepSpeed's attributes (zero/init.py): Transformers and Lightning count parameters with
            # `p.ds_numel if hasattr(p, "ds_numel") else p.numel()`; code detecting ZeRO-3 reads `ds_id`.
            # A parameter has no chunk of its own here (the unit is partitioned as one), so no `ds_tensor`.
            mark_zero_param(p, shape, group, _DS_STATUS[self._state], persist=persistent)
        self._work = None  # the gather in flight (GATHERING only)
        self.fetch_with_all_reduce = False  # [Note: how a unit is gathered]
        self.allgather_sequential = False
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        # Parameter offload (swap/param_swapper.py): between uses the shard lives in its home on the tier.
        # Persistent units stay gathered anyway, so they keep their shard where it is.
        self._home = None
        if tier is not None and not persistent:
            self._home = tier.home_for(self._shard, f"{names[0]}.{group_index}")
            self._shard, self._shard_copy = None, ShardCopy.AT_HOME
        elif weights is not None and not persistent:  # zero_quantized_nontrainable_weights
            self._home = weights.home_for_frozen(self, self._shard)
            if self._home is not None:
                self._shard, self._shard_copy = None, ShardCopy.AT_HOME
        if not persistent:
            self.live.numel += self.padded_numel  # the packed values count until released just below
            self.free()
            self._drop_secondary()  # hpZ keeps what a gather brought, not the values the unit was built from

    # -- state ----------------------------------------------------------------------------------------------

    @property
    def state(self) -> UnitState:
        return self._state

    @property
    def label(self) -> str:
        more = f" and {len(self.names) - 1} more" if len(self.names) > 1 else ""
        return f"parameter unit [{self.names[0]}{more}] (group {self.group_index})"

    def _enter(self, new: UnitState) -> None:
        """The one place a unit's data state changes: checks the transition, charges or discharges the live
        budget and publishes every parameter's `ds_status` [Note: stage 3 lifecycle]."""
        old = self._state
        if new not in _NEXT[old]:
            raise UnitStateError(f"{self.label}: illegal transition {old.name} -> {new.name}")
        self._state = new
        if not self.persistent and UnitState.RELEASED in (old, new):
            self.live.numel += self.padded_numel if old is UnitState.RELEASED else -self.padded_numel
        status = _DS_STATUS[new]
        for p in self.params:
            p.ds_status = status

    @property
    def flat(self) -> torch.Tensor | None:
        """The full buffer while gathered or being gathered; None while released."""
        return None if self._state is UnitState.RELEASED else self._full

    @flat.setter
    def flat(self, value: torch.Tensor) -> None:  # FlatParamBucket's construction
        self._full = value  # the one full buffer, released by resizing its storage [Note: one storage]

    @property
    def gathered(self) -> bool:
        """Not released: the full buffer exists (gathered, or a gather into it in flight)."""
        return self._state is not UnitState.RELEASED

    @property
    def idle(self) -> bool:
        """Nothing holds the unit: no module is inside its forward and its backward is not waiting for it."""
        return self.refs == 0 and self.awaiting is Awaiting.NOTHING

    def hold(self) -> None:
        """Gather the unit (waiting for the data) and keep it gathered until the matching `let_go`; holds
        nest (a `GatheredParameters` block inside a module's forward, an export during generation)."""
        self.gather()
        self.refs += 1

    def let_go(self, keep_taken_views: bool = False) -> None:
        """End one `hold`; the last one releases the unit."""
        self.refs -= 1
        if self.refs == 0:
            self.free(keep_taken_views=keep_taken_views)

    def expect_gradients(self) -> None:
        """A backward through the unit has begun: keep its full values until its gradients are staged."""
        if self.group_index is None:
            raise UnitStateError(
                f"{self.label}: illegal transition {self.awaiting.name} -> {Awaiting.GRADIENTS.name} "
                "(a frozen unit gets no gradients)"
            )
        self.awaiting = Awaiting.GRADIENTS

    def gradients_done(self) -> None:
        """Its gradients are staged, or the backward is over: the step expects nothing more of the unit."""
        self.awaiting = Awaiting.NOTHING

    def _drop_secondary(self) -> None:
        self.secondary, self.secondary_values = None, None

    # -- the shard and its offload home ---------------------------------------------------------------------

    @property
    def shard(self) -> torch.Tensor:
        """This rank's shard, loaded from its offload home if need be. Whoever asks for it may write it
        (optimizer step, checkpoint load, GatheredParameters), so it is written home at the next release."""
        shard = self.read_shard()
        if self._home is not None:
            self._shard_copy = ShardCopy.MODIFIED
        self._drop_secondary()  # hpZ: a copy of the old values (every rank writes its shard together)
        return shard

    def read_shard(self) -> torch.Tensor:
        """This rank's shard for reading only (loaded if need be, not marked as changed)."""
        if self._shard_copy is ShardCopy.AT_HOME:
            self._shard, self._shard_copy = self._home.load(), ShardCopy.IN_MEMORY
        return self._shard

    @property
    def home(self):
        """Where the shard lives between uses (parameter offload, quantized frozen weights), or None."""
        return self._home

    @property
    def offloaded_to_disk(self) -> bool:
        """Between uses this unit's shard lives in a file (parameter offload to NVMe)."""
        return self._home is not None and self._home.on_disk

    def shard_in_memory(self) -> torch.Tensor | None:
        """The shard if it is in memory now, else None (memory accounting must not load it)."""
        return self._shard

    def replace_shard(self, value: torch.Tensor) -> None:
        """As FlatParamBucket's; an offloaded shard that is not in memory is replaced in its home without
        being read first (the step overwrites it whole)."""
        if self._shard_copy is ShardCopy.AT_HOME:
            self._home.replace(value)
            return
        super().replace_shard(value)  # through `self.shard`: marked changed, written home at eviction

    def prefetch_shard(self) -> bool:
        """Start bringing an offloaded shard in ahead of its gather; False when the read-ahead budget is full."""
        if self._shard_copy is not ShardCopy.AT_HOME:
            return True
        return self._home.prefetch()

    def evict(self) -> None:
        """Send an offloaded shard back to its home (written only if it may have changed)."""
        if self._home is None or self._shard_copy is ShardCopy.AT_HOME:
            return
        if self._shard_copy is ShardCopy.MODIFIED:
            self._home.store(self._shard)
        self._home.drop()
        self._shard, self._shard_copy = None, ShardCopy.AT_HOME

    def move_to(self, device: torch.device, pin_memory: bool = False, non_blocking: bool = False) -> None:
        """Move the unit's shard (and, when gathered, its full buffer) to `device` (`engine.offload_states`;
        not with parameter offload, whose shards have their own home)."""
        self.wait_for_gather()
        if self._shard is not None:  # in place: in fp32 training the optimizer's master is this very tensor
            self._shard.data = _moved(self._shard.data, device, pin_memory, non_blocking)
        if self._state is UnitState.GATHERED:  # persistent: its parameters are views of the full buffer
            self._full = _moved(self._full, device, pin_memory, non_blocking)
            self.bind()
        elif self._full.device != torch.device(device):  # released: a storage of zero bytes, re-made there
            self._full = _released_buffer(self.padded_numel, self.dtype, device)
        self._empty = torch.empty(0, dtype=self.dtype, device=device)
        self.device = torch.device(device)
        if self._state is UnitState.RELEASED:
            for p in self.params:
                p.data = self._empty

    # -- transitions ----------------------------------------------------------------------------------------

    def gather(self, async_op: bool = False, for_training: bool = False) -> None:
        """Start (or finish) the all-gather of every rank's shard into the unit's full buffer (its storage
        re-allocated: [Note: one storage per unit]). `for_training`: a gather for the model's forward or
        backward, which ZeRO++ may serve quantized or from the node; other gathers get the exact values
        (an idle unit holding quantized ones is gathered again)."""
        if self._state is UnitState.RELEASED:
            self._full.untyped_storage().resize_(self.padded_numel * self._full.element_size())
            self._start_gather(for_training)
        elif self.values is Values.QUANTIZED and not for_training and self.idle:
            self.wait_for_gather()
            self._start_gather(for_training=False)
        if not async_op:
            self.wait_for_gather()

    def _start_gather(self, for_training: bool) -> None:
        self._enter(UnitState.GATHERING)
        if self.weights is None:
            self._work, self.values = self._launch_gather(), Values.EXACT
            return
        self._work, self.values = self.weights.start(self, for_training and not self.persistent)

    def _launch_gather(self):
        """The collective(s) filling the full buffer from every rank's shard [Note: how a unit is gathered]."""
        shard = self.read_shard()
        if not (self.fetch_with_all_reduce or self.allgather_sequential):
            return all_gather_flat(self.flat, shard, group=self.group, async_op=True)
        ranges = [(0, self.padded_numel)]
        if self.allgather_sequential:
            ranges = [(o, o + n) for o, n in zip(self.offsets, self.numels)] + [
                (self.numel, self.padded_numel)
            ]
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        works = []
        for start, end in ranges:
            if start == end:
                continue
            piece = self.flat[start:end].zero_()
            a, b = max(start, lo), min(end, hi)
            if a < b:
                piece[a - start : b - start].copy_(shard[a - lo : b - lo])
            works.append(all_reduce(piece, group=self.group, async_op=True))
        return _Works(works)

    def wait_for_gather(self) -> None:
        """Finish a gather in flight (GATHERING -> GATHERED); nothing otherwise."""
        if self._state is not UnitState.GATHERING:
            return
        self._work.wait()
        self._work = None
        self.bind()
        self._enter(UnitState.GATHERED)
        if self._shard_copy is not ShardCopy.MODIFIED:
            self.evict()  # an unchanged offloaded shard is not needed while its unit is gathered

    def free(self, keep_taken_views: bool = False, persistent_too: bool = False) -> None:
        """Drop the full buffer (GATHERED -> RELEASED, after finishing a gather in flight); parameters become
        empty until the next gather. Persistent units stay gathered; a released unit stays released. Either
        way an offloaded shard goes home.

        `keep_taken_views` (the end of a user's `GatheredParameters` block): tensors the user took from the
        parameters inside the block (`p.detach()`) keep their values, as in DeepSpeed: the buffer is let go
        (freed once the last such tensor is) and the next gather fills a new one, instead of freeing the
        storage in place [Note: one storage]. Only while no backward needs the unit's saved views.

        `persistent_too` (`engine.empty_partition_cache`): a persistent unit is released as well; its next
        use gathers it again, and it stays gathered from then on."""
        if self.persistent and not persistent_too:
            return
        self.wait_for_gather()
        if self._state is UnitState.GATHERED:
            if self.weights is not None and self.secondary is None:  # hpZ: before the buffer goes
                self.secondary = self.weights.secondary_copy(self)
                self.secondary_values = self.values if self.secondary is not None else None
            self._enter(UnitState.RELEASED)
            self.values = None
            for p in self.params:
                p.data = self._empty
            if keep_taken_views and self.awaiting is Awaiting.NOTHING:
                self._full = _released_buffer(self.padded_numel, self.dtype, self._full.device)
            else:
                self._full.untyped_storage().resize_(0)  # also what autograd saved of it [Note: one storage]
        self.evict()

    def refresh(self) -> None:
        """After an optimizer step: persistent units re-gather their updated values (unless
        `empty_partition_cache` released them: then their next use does), others stay released."""
        if self.persistent and self._state is not UnitState.RELEASED:
            self.wait_for_gather()
            self._start_gather(for_training=False)
            self.wait_for_gather()
        else:
            self.free()
            if self.group_index is not None:
                self._drop_secondary()  # the step changed the shards (frozen units keep theirs)


def plan_units(root: nn.Module, unit_numel: int) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Group parameters into units, in module (≈ forward) order.

    A module whose subtree holds at most `unit_numel` elements (or has no children), or that is marked as a
    ZeRO-3 leaf (`_z3_leaf`, utils/z3_leaf_module.py), is one unit; a larger module contributes its own
    direct parameters as a unit and is split into its children. A parameter shared by several modules (tied
    weights) belongs to the first unit that reaches it.
    """
    seen: set[int] = set()
    units: list[tuple[nn.Module, list[nn.Parameter]]] = []

    def take(params) -> list[nn.Parameter]:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return fresh

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        leaf = getattr(module, "_z3_leaf", False)
        if leaf or not children or sum(logical_numel(p) for p in module.parameters()) <= unit_numel:
            params = take(module.parameters())
            if params:
                units.append((module, params))
            return
        own = take(p for p in module._parameters.values() if p is not None)
        if own:
            units.append((module, own))
        for child in children:
            visit(child)

    visit(root)
    return units


def _released_buffer(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A unit's full buffer in its released state: `numel` elements over a storage of zero bytes (nothing
    allocated), which a gather resizes and fills."""
    return torch.empty(0, dtype=dtype, device=device).set_(
        torch.UntypedStorage(0, device=device), 0, (numel,)
    )
