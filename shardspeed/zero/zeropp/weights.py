"""qwZ and hpZ: how ZeRO-3 gathers a unit's parameters for forward and backward under ZeRO++.

[Note: ZeRO++ gathers] A unit's gather for the model's forward or backward (`ParamUnit.gather(for_training=
True)`, which the coordinator uses) takes the first of these that applies:

1. hpZ (`zero_hpz_partition_size` = h > 1): when the unit holds a *secondary shard* — its 1/h slice of the
   full parameters, kept when the unit was last released — the gather is an all-gather of secondary
   shards over the unit's h-rank secondary group (the ranks of one node when h is the ranks per node), in
   full precision. A unit keeps its secondary shard from its first release after an optimizer step until
   the next step (or anything else that writes its shard), as DeepSpeed's `ds_secondary_tensor`: the first
   forward of each step gathers across nodes, every later gather of that step (the backward's, and the
   next micro-batches' with gradient accumulation) stays in the node. Frozen units keep theirs for good.
2. `zero_quantized_nontrainable_weights`: a frozen unit stored as int8 records gathers those bytes.
3. qwZ (`zero_quantized_weights`): each rank quantizes its shard to int8 blocks plus fp32 scales
   (quantize.py), the records are all-gathered in one collective and dequantized into the full buffer.

Otherwise (and always for gathers that must be exact: `GatheredParameters`, checkpoint export,
`unwrap_model_for_generation`, `destroy()`, persistent units) it is the plain all-gather of the shards.
The fp32 master weights and the shards themselves stay exact; only what the model computes with is
quantized. Forward and backward of a step see the same values: without hpZ both dequantize the same
records, with hpZ the secondary shard is a copy of what forward used. Which path a unit takes depends only
on the order of gathers and releases and on collective events (step, load), identical on every rank, so
every rank joins the same collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_flat, then
from shardspeed.zero.param_units import Values
from shardspeed.zero.zeropp.quantize import BlockLayout, dequantize, quantize

__all__ = ["QuantizedHome", "WeightGather"]


class WeightGather:
    """The ZeRO++ gather paths one stage 3 wrapper's units share (see [Note: ZeRO++ gathers])."""

    def __init__(self, *, quantize_weights: bool, quantize_frozen: bool = False, hpz_group=None,
                 hpz_size: int = 1):  # fmt: skip
        self.quantize_weights = quantize_weights
        self.quantize_frozen = quantize_frozen
        self.hpz_group, self.hpz_size = hpz_group, hpz_size
        self.hpz_rank = dist.get_rank(hpz_group) if hpz_size > 1 else 0
        self._layouts: dict[int, BlockLayout] = {}  # id(unit) -> its int8 blocks, worked out once

    def layout(self, unit) -> BlockLayout:
        if id(unit) not in self._layouts:
            self._layouts[id(unit)] = BlockLayout.for_weights(unit)
        return self._layouts[id(unit)]

    def start(self, unit, for_training: bool):
        """Start filling `unit.flat`. Returns (work, values): `Values.QUANTIZED` when the values are not the
        exact shards (quantized ones, or a secondary copy of quantized ones), else `Values.EXACT`."""
        if for_training and unit.secondary is not None:
            work = all_gather_flat(unit.flat, unit.secondary, group=self.hpz_group, async_op=True)
            return work, unit.secondary_values
        if isinstance(unit.home, QuantizedHome):  # stored quantized: these bytes are the exact values
            return _gather_records(unit, unit.home.records, unit.home.layout), Values.EXACT
        if for_training and self.quantize_weights:
            layout = self.layout(unit)
            records = quantize(unit.read_shard().view(1, -1), layout, [unit.rank])
            return _gather_records(unit, records, layout), Values.QUANTIZED
        return all_gather_flat(unit.flat, unit.read_shard(), group=unit.group, async_op=True), Values.EXACT

    def secondary_copy(self, unit) -> torch.Tensor | None:
        """hpZ: this rank's slice of a gathered unit's full parameters, which the unit keeps when released
        (once per step); None without hpZ. Costs 1/h of the unit's memory until the next step."""
        if self.hpz_size <= 1:
            return None
        size = unit.padded_numel // self.hpz_size
        return unit.flat[self.hpz_rank * size : (self.hpz_rank + 1) * size].clone()

    def home_for_frozen(self, unit, shard: torch.Tensor):
        """Where a frozen, non-persistent unit keeps its shard between uses: int8 records with
        `zero_quantized_nontrainable_weights`, else nowhere special (None)."""
        if not (self.quantize_frozen and unit.group_index is None):
            return None
        return QuantizedHome(shard, self.layout(unit), unit.rank)


def _gather_records(unit, records: torch.Tensor, layout: BlockLayout):
    """All-gather every rank's quantized shard (one record each) and dequantize into the unit's buffer."""
    flat = unit.flat
    gathered = torch.empty(unit.world * layout.record_bytes, dtype=torch.uint8, device=flat.device)
    work = all_gather_flat(gathered, records.view(-1), group=unit.group, async_op=True)

    def finish() -> None:
        flat.view(unit.world, unit.shard_numel).copy_(dequantize(gathered, layout, range(unit.world)))

    return then(work, finish)


class QuantizedHome:
    """A frozen unit's shard kept as int8 records (`zero_quantized_nontrainable_weights`, DeepSpeed's
    storage for LoRA-style frozen weights): a quarter of fp32's bytes, half of 16-bit's. The same interface
    as parameter offload's homes (swap/param_swapper.py): `load()` gives the (dequantized) shard, `store()`
    quantizes a changed one back. The weights lose precision once, when stored; gathers move the records."""

    on_disk = False

    def __init__(self, shard: torch.Tensor, layout: BlockLayout, rank: int):
        self.dtype, self.device = shard.dtype, shard.device
        self.layout, self.rank = layout, rank
        self.records = quantize(shard.view(1, -1), layout, [rank]).view(-1)

    def load(self) -> torch.Tensor:
        return dequantize(self.records, self.layout, [self.rank], self.dtype).view(-1)

    def store(self, value: torch.Tensor) -> None:
        self.records = quantize(value.reshape(1, -1).to(self.device), self.layout, [self.rank]).view(-1)

    replace = store

    def prefetch(self) -> bool:
        return True

    def drop(self) -> None:
        pass
