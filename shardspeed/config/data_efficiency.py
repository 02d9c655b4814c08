"""Config blocks of the data-efficiency library (``data_efficiency``) and the legacy ``curriculum_learning``.

Keys and defaults are DeepSpeed's (``runtime/data_pipeline/constants.py`` and ``config.py``). DeepSpeed reads
these blocks as plain dicts and asserts on a missing key only when the feature starts; here every key is
typed, a missing required key is an error naming it when the config loads, and an unknown key is refused.

One difference: DeepSpeed turns curriculum sampling and random-LTD on by their own ``enabled`` alone, even
when a block above them (``data_efficiency``, ``data_sampling``, ``data_routing``) says false. Such a config
is ambiguous, so it is refused with an error naming both switches.

What shardspeed does not build is refused by name when enabled (``implemented.py``): ``dynamic_batching``
(variable batch size and LR scaling) and random-LTD's ``layer_token_lr_schedule`` (DeepSpeed raises
``NotImplementedError`` for it itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .blocks import NonNegInt, PositiveInt
from .build import join
from .errors import ConfigError

__all__ = [
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumScheduleConfig",
    "DataEfficiencyConfig",
    "DataRoutingConfig",
    "DataSamplingConfig",
    "DynamicBatchingConfig",
    "LayerTokenLrScheduleConfig",
    "LegacyCurriculumConfig",
    "RandomLtdConfig",
    "RandomLtdScheduleConfig",
    "RandomLtdScheduleParams",
]

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]

# The schedule_config keys each schedule type needs (DeepSpeed's CurriculumScheduler asserts the same).
_SCHEDULE_NEEDS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


@dataclass(kw_only=True)
class CurriculumScheduleConfig:
    """the pacing function's parameters (which ones: see ``schedule_type``)."""

    total_curriculum_step: PositiveInt | None = None
    """Steps from min_difficulty to max_difficulty (fixed_linear, fixed_root)."""
    difficulty_step: PositiveInt | None = None
    """Every difficulty is a multiple of this (fixed_linear, fixed_root)."""
    root_degree: PositiveInt | None = None
    """Degree of the root: 2 is a square root, 1 is linear (fixed_root)."""
    difficulty: list[int] | None = None
    """The difficulties in turn (fixed_discrete)."""
    max_step: list[int] | None = None
    """The last step of each difficulty but the last; one entry fewer than difficulty (fixed_discrete)."""

    def check_for(self, schedule_type: str, path: str) -> None:
        """Raise naming the first key ``schedule_type`` needs that is missing, or a malformed list."""
        for key in _SCHEDULE_NEEDS[schedule_type]:
            if getattr(self, key) is None:
                raise ConfigError(f"{join(path, key)}: required by schedule_type '{schedule_type}'")
        discrete = schedule_type == "fixed_discrete"
        if discrete and (not self.max_step or len(self.difficulty) != len(self.max_step) + 1):
            raise ConfigError(
                f"{join(path, 'difficulty')}: needs exactly one entry more than max_step (the last "
                f"difficulty holds after the last max_step), got {len(self.difficulty)} and {len(self.max_step)}"
            )


def _check_curriculum(block, path: str) -> None:
    """The checks every curriculum gets: a range that rises, and the parameters its schedule needs."""
    if block.max_difficulty < block.min_difficulty:
        raise ConfigError(
            f"{join(path, 'max_difficulty')}: {block.max_difficulty} is below min_difficulty {block.min_difficulty}"
        )
    block.schedule_config.check_for(block.schedule_type, join(path, "schedule_config"))


@dataclass(kw_only=True)
class LegacyCurriculumConfig:
    """DeepSpeed's legacy curriculum: ``curriculum_seqlen=<difficulty>`` passed to the model's forward.

    DeepSpeed 0.19.8 removed this block from its config (it refuses it); shardspeed keeps it."""

    REQUIRED_EXAMPLE = " (an enabled curriculum needs min_difficulty, max_difficulty and schedule_type)"

    enabled: bool = False
    """Apply the curriculum. Default false."""
    curriculum_type: Literal["seqlen"] = "seqlen"
    """The difficulty metric; only "seqlen" (DeepSpeed has no other). Default "seqlen"."""
    min_difficulty: int | None = None
    """Difficulty (sequence length) at the first step. Required when enabled."""
    max_difficulty: int | None = None
    """Final difficulty. Required when enabled."""
    schedule_type: ScheduleType | None = None
    """Pacing function: fixed_linear, fixed_root, fixed_discrete, custom. Required when enabled."""
    schedule_config: CurriculumScheduleConfig = field(default_factory=CurriculumScheduleConfig)
    """The pacing function's parameters."""

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is None:
                raise ConfigError(f"{join(path, key)}: required when curriculum learning is enabled")
        _check_curriculum(self, path)


@dataclass(kw_only=True)
class CurriculumMetricConfig:
    """one difficulty metric and its schedule (the key is the metric's name)."""

    min_difficulty: int
    """Difficulty at the first step (a metric value, or a percentile)."""
    max_difficulty: int
    """Final difficulty."""
    schedule_type: ScheduleType
    """Pacing function: fixed_linear, fixed_root, fixed_discrete, or custom (a function set with
    engine.set_custom_curriculum_learning_schedule)."""
    schedule_config: CurriculumScheduleConfig = field(default_factory=CurriculumScheduleConfig)
    """The pacing function's parameters."""
    index_to_sample_path: str | None = None
    """The data analyzer's <metric>_index_to_sample file (without .bin/.idx); needed unless
    clustering_type is single_cluster."""
    index_to_metric_path: str | None = None
    """The data analyzer's <metric>_index_to_metric file; needed with difficulty_type "value"."""
    difficulty_type: Literal["value", "percentile"]
    """Difficulties are metric values, or percentiles of the samples sorted by the metric."""
    clustering_type: Literal["schedule_based", "single_cluster"]
    """schedule_based: clusters of samples per difficulty range; single_cluster: every sample in one
    cluster (the curriculum is applied by the script, e.g. truncating to the difficulty)."""

    def validate(self, path: str) -> None:
        _check_curriculum(self, path)
        if self.clustering_type == "single_cluster":
            return
        if self.index_to_sample_path is None:
            raise ConfigError(
                f"{join(path, 'index_to_sample_path')}: required with schedule_based clustering"
            )
        if self.difficulty_type == "value" and self.index_to_metric_path is None:
            raise ConfigError(f"{join(path, 'index_to_metric_path')}: required with difficulty_type 'value'")


@dataclass(kw_only=True)
class CurriculumLearningConfig:
    """``data_sampling.curriculum_learning``: sample batches from the data a curriculum allows so far."""

    enabled: bool = False
    """Use the curriculum sampler. Default false."""
    data_cluster_path: str | None = None
    """Folder where the sampler writes its clusters (sample indices per difficulty range). Required when
    enabled."""
    curriculum_metrics: dict[str, CurriculumMetricConfig] = field(default_factory=dict)
    """Metric name -> its curriculum. At least one when enabled."""

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        if self.data_cluster_path is None:
            raise ConfigError(
                f"{join(path, 'data_cluster_path')}: required when curriculum learning is enabled"
            )
        if not self.curriculum_metrics:
            raise ConfigError(
                f"{join(path, 'curriculum_metrics')}: curriculum learning is enabled, give a metric"
            )


@dataclass(kw_only=True)
class DynamicBatchingConfig:
    """``data_sampling.dynamic_batching``: variable batch sizes packed to a token budget, LR scaled."""

    enabled: bool = False
    """Pack batches by token count. Default false."""
    metrics_path: str | None = None
    """The data analyzer's sequence-length metric. Default null."""
    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    """How the LR follows the batch size. Default "linear"."""
    min_batch_size: PositiveInt = 1
    """Smallest batch. Default 1."""
    max_batch_size: PositiveInt | None = None
    """Largest batch. Default null."""
    sequence_picking_order: Literal["random", "seqlen", "dataloader"] = "dataloader"
    """Order in which sequences are packed. Default "dataloader"."""
    max_tokens: PositiveInt | None = None
    """Token budget per batch. Default null."""
    verbose: bool = False
    """Log the batches. Default false."""


@dataclass(kw_only=True)
class DataSamplingConfig:
    """data sampling: the curriculum sampler's options."""

    enabled: bool = False
    """Use data sampling. Default false."""
    num_epochs: PositiveInt = 1000
    """Epochs the curriculum sampler may draw (its length is this times the dataset). Default 1000."""
    num_workers: NonNegInt = 0
    """DataLoader workers of the curriculum loader. Default 0."""
    pin_memory: bool = False
    """Pin the curriculum loader's batches. Default false."""
    curriculum_learning: CurriculumLearningConfig = field(default_factory=CurriculumLearningConfig)
    """Curriculum learning over metric-indexed data."""
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    """Variable batch size and LR."""


@dataclass(kw_only=True)
class RandomLtdScheduleParams:
    """the linear schedule's parameters."""

    require_steps: PositiveInt
    """Steps from min_value to max_value."""
    seq_per_step: PositiveInt
    """The kept length is a multiple of this."""


@dataclass(kw_only=True)
class RandomLtdScheduleConfig:
    """``random_ltd.random_ltd_schedule``: the number of tokens the dropping layers keep, over the steps."""

    min_value: PositiveInt
    """Tokens kept at step 0."""
    max_value: PositiveInt
    """Tokens kept at the end (usually the full sequence length)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """Only "fixed_linear" (DeepSpeed has no other). Default "fixed_linear"."""
    schedule_config: RandomLtdScheduleParams
    """The linear schedule's parameters."""

    def validate(self, path: str) -> None:
        if self.max_value < self.min_value:
            raise ConfigError(
                f"{join(path, 'max_value')}: {self.max_value} is below min_value {self.min_value}"
            )


@dataclass(kw_only=True)
class LayerTokenLrScheduleConfig:
    """``random_ltd.layer_token_lr_schedule``: an LR schedule over consumed layer-tokens."""

    enabled: bool = False
    """DeepSpeed raises NotImplementedError when true. Default false."""
    total_layer_tokens: PositiveInt | None = None
    """Layer-tokens of the whole run. Default null."""
    warmup_type: str | None = None
    """Warm-up shape. Default null."""
    warmup_layer_tokens: NonNegInt | None = None
    """Layer-tokens of the warm-up. Default null."""


@dataclass(kw_only=True)
class RandomLtdConfig:
    """``data_routing.random_ltd``: random layerwise token dropping."""

    REQUIRED_EXAMPLE = " (an enabled random_ltd block needs every key of DeepSpeed's example)"

    enabled: bool = False
    """Drop tokens in the chosen layers. Default false."""
    total_layer_num: PositiveInt | None = None
    """Layers of the model (for the consumed layer-token count). Required when enabled."""
    random_ltd_layer_num: PositiveInt | None = None
    """How many layers drop tokens. Required when enabled."""
    random_ltd_layer_id: list[int] | None = None
    """Which layers drop tokens (a layer is chosen when this number appears in its module name). Required
    when enabled."""
    model_mask_name: str | None = None
    """The layer's keyword argument holding the attention mask; null when it takes none. Default null."""
    model_type: Literal["encoder", "decoder"] | None = None
    """decoder: the causal mask is cut to the kept length; encoder: the mask rows and columns of the kept
    tokens are gathered. Required when enabled."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] | None = None
    """Layout of the hidden states the layers take. Required when enabled."""
    random_ltd_schedule: RandomLtdScheduleConfig | None = None
    """Tokens kept over the steps. Required when enabled."""
    layer_token_lr_schedule: LayerTokenLrScheduleConfig = field(default_factory=LayerTokenLrScheduleConfig)
    """LR over consumed layer-tokens."""

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_type",
                    "hidden_state_order", "random_ltd_schedule"):  # fmt: skip
            if getattr(self, key) is None:
                raise ConfigError(f"{join(path, key)}: required when random_ltd is enabled")
        if len(self.random_ltd_layer_id) != self.random_ltd_layer_num:
            raise ConfigError(
                f"{join(path, 'random_ltd_layer_id')}: {len(self.random_ltd_layer_id)} layer ids but "
                f"random_ltd_layer_num is {self.random_ltd_layer_num}"
            )
        if self.random_ltd_layer_num > self.total_layer_num:
            raise ConfigError(
                f"{join(path, 'random_ltd_layer_num')}: {self.random_ltd_layer_num} is above total_layer_num "
                f"{self.total_layer_num}"
            )


@dataclass(kw_only=True)
class DataRoutingConfig:
    """data routing: which tokens each layer processes."""

    enabled: bool = False
    """Use data routing. Default false."""
    random_ltd: RandomLtdConfig = field(default_factory=RandomLtdConfig)
    """Random layerwise token dropping."""


@dataclass(kw_only=True)
class DataEfficiencyConfig:
    """``data_efficiency``: data sampling (curriculum learning) and data routing (random-LTD)."""

    enabled: bool = False
    """Use the data-efficiency library. Default false."""
    seed: int = 1234
    """Seed of the curriculum sampler's shuffles and draws. Default 1234."""
    data_sampling: DataSamplingConfig = field(default_factory=DataSamplingConfig)
    """Data sampling (curriculum learning)."""
    data_routing: DataRoutingConfig = field(default_factory=DataRoutingConfig)
    """Data routing (random-LTD)."""

    @property
    def curriculum_enabled(self) -> bool:
        """Curriculum sampling is on (every switch on its path is true)."""
        return self.enabled and self.data_sampling.enabled and self.data_sampling.curriculum_learning.enabled

    @property
    def random_ltd_enabled(self) -> bool:
        """Random-LTD is on (every switch on its path is true)."""
        return self.enabled and self.data_routing.enabled and self.data_routing.random_ltd.enabled

    def validate(self, path: str) -> None:
        sampling, routing = self.data_sampling, self.data_routing
        _switches_agree(path, [("enabled", self.enabled), ("data_sampling.enabled", sampling.enabled),
                               ("data_sampling.curriculum_learning.enabled", sampling.curriculum_learning.enabled)])  # fmt: skip
        _switches_agree(path, [("enabled", self.enabled), ("data_routing.enabled", routing.enabled),
                               ("data_routing.random_ltd.enabled", routing.random_ltd.enabled)])  # fmt: skip


def _switches_agree(path: str, switches: list[tuple[str, bool]]) -> None:
    """A feature's own switch is on while a block above it is off: DeepSpeed would run it, the outer switch
    says not to. Refuse rather than pick one reading."""
    feature, on = switches[-1]
    if not on:
        return
    off = [name for name, value in switches[:-1] if not value]
    if off:
        raise ConfigError(
            f"{join(path, feature)}: true while {', '.join(join(path, name) for name in off)} is false "
            "(DeepSpeed reads only the inner switch and would run it); set both true, or the inner one false"
        )
