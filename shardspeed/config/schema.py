"""``ShardspeedConfig``: the whole DeepSpeed JSON config as one typed object (reference §2).

Each top-level key is a field; blocks are the dataclasses of ``blocks.py``, ``zero.py``, ``monitoring.py``
and ``features.py``. Build it with ``load_config`` (``loader.py``), which also maps deprecated keys, runs the
cross-block checks (``validate.py``), resolves the batch triple and refuses keys of features shardspeed does
not implement (``implemented.py``). Keys DeepSpeed 0.19 removed are not fields: ``implemented.py`` refuses
them with DeepSpeed's own reason.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from .blocks import (
    Bf16Config,
    CheckpointConfig,
    DataTypesConfig,
    DtypeName,
    Fp16Config,
    NonNegFloat,
    OptimizerConfig,
    PositiveFloat,
    PositiveInt,
    SchedulerConfig,
    TorchAutocastConfig,
)
from .build import Key, show
from .compression_blocks import CompressionTrainingConfig
from .data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig
from .errors import ConfigError
from .features import (
    ActivationCheckpointingConfig,
    AioConfig,
    AutotuningConfig,
    CompileConfig,
    ExpertParallelConfig,
    HybridEngineConfig,
    PipelineConfig,
    WeightQuantizationConfig,
)
from .monitoring import (
    CometConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
)
from .tensor_parallel import TensorParallelConfig
from .zero import ZeroConfig


def _infinity_means_never(value: Any) -> Any:
    """``steps_per_print``: positive infinity (JSON ``Infinity``, ``float("inf")``, "inf") means never print."""
    if isinstance(value, float) and math.isinf(value) and value > 0:
        return None
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity", "+infinity"):
        return None
    return value


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _allreduce_op(value: Any) -> Any:
    """``gradient_allreduce_op``, case-folded; an unknown name is refused in DeepSpeed's words ("Invalid
    gradient_allreduce_op"), which scripts and DeepSpeed's own tests match on."""
    op = _lower(value)
    if isinstance(op, str) and op not in ("mean", "sum"):
        raise ConfigError(f"Invalid gradient_allreduce_op {show(value)}: must be one of 'mean', 'sum'")
    return op


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


def _false_means_off(value: Any) -> Any:
    return None if value is False else value


LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


__all__ = ["ShardspeedConfig"]

FreeForm = dict[str, Any] | None


@dataclass(kw_only=True)
class ShardspeedConfig:
    """A validated DeepSpeed config. After ``load_config`` the three batch fields are resolved ints."""

    # ---- batch (reference §2.1); resolved by batch.resolve_batch_sizes ----
    train_batch_size: PositiveInt | None = None
    """Global batch: micro batch x accumulation steps x data-parallel world size."""
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: PositiveInt | None = None
    """Micro-batches per optimizer step."""
    managed_gradient_accumulation: bool = True
    """True: the engine counts micro-steps and steps the optimizer at the boundary. False: the script owns
    the boundary and every ``step()`` applies an update. Default true."""

    # ---- precision (§2.2) ----
    fp16: Fp16Config = field(default_factory=Fp16Config)
    """fp16 training with loss scaling."""
    bf16: Annotated[Bf16Config, Key(aliases=("bfloat16",))] = field(default_factory=Bf16Config)
    """bf16 training (legacy name "bfloat16" accepted)."""
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    """torch.autocast around forward."""
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    """Dtypes of internal buffers."""

    # ---- optimizer and schedule (§2.3) ----
    optimizer: OptimizerConfig | None = None
    """Optimizer built from config when the script passes none; null = none."""
    scheduler: SchedulerConfig | None = None
    """LR schedule built from config when the script passes none; null = none."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer DeepSpeed has not tested with ZeRO. Default false."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require DeepSpeed's CPU optimizer. Default true."""

    # ---- gradients and communication (§2.4) ----
    gradient_clipping: NonNegFloat = 1.0
    """Clip gradients to this global norm; 0 = off. Default 1.0, as DeepSpeed 0.19.8's code (0.16 used 0.0)."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before the all-reduce instead of after. Default false."""
    gradient_predivide_factor: PositiveFloat = 1.0
    """Divide by this before the all-reduce and by world/factor after. Default 1.0."""
    communication_data_type: DtypeName | None = None
    """Dtype of gradient communication: fp32, fp16, bf16; null = the model's dtype."""
    seq_parallel_communication_data_type: DtypeName = "fp32"
    """Dtype of gradient communication under sequence parallelism (sequence_parallel_size > 1), where it
    replaces communication_data_type. Default fp32."""
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], Key(normalize=_allreduce_op)] = "mean"
    """How data-parallel gradients combine: "mean" (averaged over ranks) or "sum" (not allowed at ZeRO
    stage 3). Default "mean"."""
    disable_allgather: bool = False
    """Parsed by DeepSpeed, unused there too. Default false."""
    use_data_before_expert_parallelism: bool = False
    """MoE group topology: data-parallel ranks before expert-parallel ones. Default false."""

    # ---- ZeRO (§2.5) ----
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stages 0-3 and offload."""
    aio: AioConfig = field(default_factory=AioConfig)
    """Asynchronous I/O for NVMe offload."""

    # ---- logging and measurement (§2.8) ----
    steps_per_print: Annotated[PositiveInt | None, Key(normalize=_infinity_means_never)] = None
    """Log progress every this many steps; null or Infinity = never (DeepSpeed's code; its docs say 10).
    Accelerate writes ``float("inf")`` here to silence the engine's logging."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/step. Default false."""
    memory_breakdown: bool = False
    """Log memory use. Default false."""
    dump_state: bool = False
    """Log the resolved config on rank 0 after initialisation. Default false."""
    log_level: Annotated[LogLevel | None, Key(normalize=_upper)] = None
    """Level of the library's logger (and its handlers): DEBUG, INFO, WARNING, ERROR, CRITICAL (any case;
    kept upper-case, the names `logging` and DeepSpeed use); null = unchanged. Default null."""
    disable_python_gc: bool = False
    """Collect once, then turn Python's automatic cyclic garbage collection off while the engine lives
    (``engine.collect_python_gc()`` collects on demand); restored by ``destroy()``. Default false."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases monitor."""
    csv_monitor: CsvMonitorConfig = field(default_factory=CsvMonitorConfig)
    """CSV monitor."""
    comet: CometConfig = field(default_factory=CometConfig)
    """Comet monitor."""
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    """Communication logger."""
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    """FLOPs profiler."""
    timers: TimersConfig = field(default_factory=TimersConfig)
    """Engine timers."""

    # ---- checkpoints and data (§2.9, §2.4) ----
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint behaviour."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of the engine's dataloader. Default false."""

    # ---- other features (§2.7, §2.10-§2.14) ----
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    """Activation checkpointing options."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline-parallel engine options."""
    autotuning: AutotuningConfig = field(default_factory=AutotuningConfig)
    """Autotuner."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """Hybrid training/generation engine (DeepSpeed-Chat's actor): `generate` from the engine being trained."""
    data_efficiency: DataEfficiencyConfig = field(default_factory=DataEfficiencyConfig)
    """Data efficiency library: curriculum sampling and random-LTD (shardspeed/data_pipeline)."""
    curriculum_learning: LegacyCurriculumConfig = field(default_factory=LegacyCurriculumConfig)
    """DeepSpeed's legacy curriculum (removed from DeepSpeed 0.19.8's config, kept here): the engine passes
    curriculum_seqlen=<difficulty> to the model's forward."""
    vocabulary_size: PositiveInt | None = None
    """Vocabulary size (a warning when not a multiple of 8, as DeepSpeed). Default null."""
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    """AutoTP training (tensor parallelism); see the block below."""
    sequence_parallel_size: PositiveInt = 1
    """Ulysses sequence-parallel degree. Above 1, `initialize` builds a (data, sequence) grid with sequence
    groups of consecutive ranks (must divide the world size); gradients are averaged and ZeRO shards over
    sequence x data ranks; the data loader splits samples over the data ranks only and each sequence rank
    keeps its slice of dimension 1; batch sizes count data ranks only (`train_batch_size = micro x gas x world
    / sp`). Wrap attention in `shardspeed.sequence.DistributedAttention(attn, engine.get_sequence_parallel_group())`.
    Default 1."""
    data_parallel_size: PositiveInt | None = None
    """Data-parallel degree of a (data, sequence) mesh; with sequence_parallel_size it must multiply to the
    world size. Default null (world size / sequence_parallel_size)."""
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    """AutoEP (automatic expert parallelism)."""
    weight_quantization: WeightQuantizationConfig | None = None
    """Quantized weights; null = off."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """DeepCompile options (``engine.compile()`` itself needs none)."""
    datastates_ckpt: Annotated[Any, Key(normalize=_false_means_off)] = None
    """DataStates asynchronous checkpointing: any value but null or false turns it on. Default null."""
    compression_training: CompressionTrainingConfig = field(default_factory=CompressionTrainingConfig)
    """Compression: weight/activation quantization, pruning, layer reduction (DeepSpeed 0.18.9's keys)."""

    # ---- set by the loader, not JSON keys ----
    raw: Annotated[dict[str, Any], Key(internal=True)] = field(default_factory=dict, repr=False)
    """The user's config exactly as given (a deep copy); saved in checkpoints as ds_config."""
    world_size: Annotated[int, Key(internal=True)] = 1
    """Data-parallel world size the batch triple was resolved for."""

    @property
    def zero_enabled(self) -> bool:
        """True when a ZeRO stage above 0 is configured."""
        return self.zero_optimization.stage > 0

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved config (every key, defaults filled in), JSON-serialisable."""
        internal = {"raw", "world_size"}
        resolved = {
            f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in internal
        }
        if resolved["compression_training"] is None:  # DeepSpeed 0.19 refuses the key even when null
            del resolved["compression_training"]
        return resolved


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
