"""`DataEfficiency`: the engine's part for the data-efficiency library and the legacy curriculum.

What DeepSpeed's engine does for these, gathered in one object the engine holds:

- legacy `curriculum_learning`: before every training forward, the difficulty of step `global_steps + 1`
  (DeepSpeed's count) becomes current and the model's forward gets `curriculum_seqlen=<difficulty>`;
- random-LTD: before every training forward, `update_seq(global_steps)`; `initialize_layers(module)` attaches
  the scheduler to the `RandomLayerTokenDrop` layers named in `random_ltd_layer_id`;
- curriculum sampling: `training_loader(...)` is the `training_data` loader over `DeepSpeedDataSampler`
  (None without a curriculum: the engine's ordinary loader is used).

Checkpoints: `checkpoint_parts()` gives `random_ltd` (the scheduler's state, DeepSpeed's key) and
`curriculum_scheduler_legacy` (the legacy difficulty; DeepSpeed does not save it, which only matters for a
`custom` schedule); the sampler's state is the loader's, saved under DeepSpeed's `data_sampler` by the
loader's own part. Each is None when its feature is off, and loading a None changes nothing.
"""

from __future__ import annotations

from collections import deque

from shardspeed.checkpoint.parts import NamedState
from shardspeed.config import ConfigError
from shardspeed.config.data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig

from .curriculum_scheduler import CurriculumScheduler
from .loader import CurriculumDataLoader
from .random_ltd.layer import RandomLayerTokenDrop
from .random_ltd.scheduler import RandomLTDScheduler
from .sampler import DeepSpeedDataSampler

__all__ = ["DataEfficiency", "refuse_for_pipeline"]


class DataEfficiency:
    def __init__(self, block: DataEfficiencyConfig, legacy: LegacyCurriculumConfig, *, train_batch_size: int,
                 module=None):  # fmt: skip
        self.block = block
        # the names the engine's optimizer wrapper is built with (a later random-LTD conversion changes them)
        self.parameter_names = [n for n, _ in module.named_parameters()] if module is not None else []
        self.legacy_scheduler = CurriculumScheduler(legacy) if legacy.enabled else None
        self.random_ltd_scheduler = None
        if block.random_ltd_enabled:
            self.random_ltd_scheduler = RandomLTDScheduler(block.data_routing.random_ltd, train_batch_size)
            if module is not None and any(isinstance(m, RandomLayerTokenDrop) for m in module.modules()):
                self.initialize_layers(module)  # converted before initialize: attach the scheduler now

    # -- forward -------------------------------------------------------------------------------------------

    def forward_kwargs(self, kwargs: dict, global_steps: int, training: bool) -> dict:
        """The forward's keyword arguments, with `curriculum_seqlen` added by the legacy curriculum."""
        if not training:
            return kwargs
        if self.legacy_scheduler is not None:
            difficulty = self.legacy_scheduler.update_difficulty(global_steps + 1)
            kwargs = {**kwargs, "curriculum_seqlen": difficulty}
        if self.random_ltd_scheduler is not None:
            self.random_ltd_scheduler.update_seq(global_steps)
        return kwargs

    # -- data ----------------------------------------------------------------------------------------------

    def training_loader(self, dataset, *, micro_batch_size: int, dp_rank: int, dp_world_size: int, dp_group,
                        gradient_accumulation_steps: int, global_rank: int, drop_last: bool, collate_fn=None,
                        tput_timer=None) -> CurriculumDataLoader | None:  # fmt: skip
        """The curriculum loader of `training_data`, or None when curriculum sampling is off."""
        if not self.block.curriculum_enabled:
            return None
        sampler = DeepSpeedDataSampler(
            self.block, len(dataset), micro_batch_size, dp_rank, dp_world_size, dp_group,
            gradient_accumulation_steps, global_rank, drop_last=drop_last,
        )  # fmt: skip
        sampling = self.block.data_sampling
        return CurriculumDataLoader(
            dataset, sampler, batch_size=micro_batch_size, collate_fn=collate_fn,
            num_workers=sampling.num_workers, pin_memory=sampling.pin_memory, drop_last=drop_last,
            tput_timer=tput_timer,
        )  # fmt: skip

    # -- random-LTD layers ---------------------------------------------------------------------------------

    def initialize_layers(self, module) -> int:
        """Attach the scheduler to the random-LTD layers named in `random_ltd_layer_id` (a layer is chosen when
        the id appears in its module name, ids in ascending order, as DeepSpeed matches them)."""
        if self.random_ltd_scheduler is None:
            raise RuntimeError(
                "random_ltd_initialize: random-LTD is not enabled (data_efficiency.enabled, "
                "data_routing.enabled and data_routing.random_ltd.enabled must all be true)"
            )
        config = self.block.data_routing.random_ltd
        pending = deque(sorted(config.random_ltd_layer_id))
        count = 0
        for name, layer in module.named_modules():
            if isinstance(layer, RandomLayerTokenDrop) and pending and str(pending[0]) in name:
                layer.init_config(config, self.random_ltd_scheduler, count)
                pending.popleft()
                count += 1
        if count != config.random_ltd_layer_num:
            raise ValueError(
                f"data_efficiency.data_routing.random_ltd: random_ltd_layer_num is {config.random_ltd_layer_num} "
                f"but {count} RandomLayerTokenDrop layers match random_ltd_layer_id {config.random_ltd_layer_id}"
            )
        return count

    # -- checkpoints ---------------------------------------------------------------------------------------

    def checkpoint_parts(self) -> list[NamedState]:
        return [
            NamedState("random_ltd", self.random_ltd_scheduler),
            NamedState("curriculum_scheduler_legacy", self.legacy_scheduler),
        ]


def refuse_for_pipeline(config) -> None:
    """The pipeline engine runs its stages itself, so nothing passes `curriculum_seqlen`, steps random-LTD or
    reads `training_data` through the curriculum sampler (DeepSpeed's pipeline engine skips them too, silently):
    refuse the blocks that would do nothing there."""
    block = config.data_efficiency
    used = [
        name
        for name, on in (
            ("curriculum_learning", config.curriculum_learning.enabled),
            ("data_efficiency.data_sampling.curriculum_learning", block.curriculum_enabled),
            ("data_efficiency.data_routing.random_ltd", block.random_ltd_enabled),
        )
        if on
    ]
    if used:
        raise ConfigError(
            f"{', '.join(used)}: not supported with a PipelineModule (the pipeline engine runs the stages itself, "
            "so nothing would apply it; DeepSpeed's pipeline engine skips it without a word); remove it or train "
            "without pipeline parallelism"
        )
