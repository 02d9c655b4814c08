"""Config blocks of features beyond the training core (reference §2.6, §2.7, §2.10, §2.12-§2.14).

Most of these are accepted and checked but not implemented yet: the loader warns when they are used
(see ``implemented.py``). Defaults are DeepSpeed's code defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from .blocks import NonNegInt, PositiveInt
from .build import Key

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "AutotuningConfig",
    "CurriculumLearningConfig",
    "DataEfficiencyConfig",
    "EigenvalueConfig",
    "ElasticityConfig",
    "HybridEngineConfig",
    "ModelInfoConfig",
    "PipelineConfig",
    "ProgressiveLayerDropConfig",
    "SparseAttentionConfig",
]


@dataclass(kw_only=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: options of ``deepspeed.checkpointing``."""

    partition_activations: bool = False
    """Split checkpointed activations across model-parallel ranks. Default false."""
    contiguous_memory_optimization: bool = False
    """Copy checkpoints into one contiguous buffer. Default false."""
    cpu_checkpointing: bool = False
    """Keep checkpointed activations in CPU memory. Default false."""
    number_checkpoints: PositiveInt | None = None
    """Number of checkpoints (for the contiguous buffer). Default null."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at each checkpoint boundary. Default false."""
    profile: bool = False
    """Time the forward/recompute of checkpoints. Default false."""


@dataclass(kw_only=True)
class AioConfig:
    """``aio``: asynchronous I/O used by NVMe offload."""

    block_size: PositiveInt = 1_048_576
    """I/O request size in bytes. Default 1048576."""
    queue_depth: PositiveInt = 8
    """I/O queue depth. Default 8."""
    intra_op_parallelism: Annotated[PositiveInt, Key(aliases=("thread_count",))] = 1
    """I/O threads per request (DeepSpeed's docs call it thread_count, accepted as an alias). Default 1."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches. Default false."""
    overlap_events: bool = True
    """Overlap submission and completion of requests. Default true."""
    use_gds: bool = False
    """Use GPUDirect Storage (CUDA only). Default false."""


@dataclass(kw_only=True)
class ElasticityConfig:
    """``elasticity``: choose batch sizes that stay valid over a range of GPU counts."""

    enabled: bool = False
    """Compute the batch triple elastically. Default false."""
    max_train_batch_size: PositiveInt = 2000
    """Largest acceptable global batch. Default 2000."""
    micro_batch_sizes: list[PositiveInt] = field(default_factory=lambda: [2, 4, 6])
    """Acceptable micro-batch sizes. Default [2, 4, 6]."""
    min_gpus: PositiveInt = 1
    """Smallest GPU count to support. Default 1."""
    max_gpus: PositiveInt = 10000
    """Largest GPU count to support. Default 10000."""
    min_time: NonNegInt = 0
    """Minimum running time (minutes) before scaling. Default 0."""
    prefer_larger_batch: Annotated[bool, Key(aliases=("prefer_large_batch",))] = True
    """Break ties toward the larger batch (DeepSpeed's docs misspell it prefer_large_batch). Default true."""
    ignore_non_elastic_batch_info: bool = False
    """Ignore batch keys given beside elasticity instead of failing. Default false."""
    version: float = 0.2
    """Elasticity algorithm version (0.1 or 0.2). Default 0.2."""
    num_gpus_per_node: PositiveInt = 1
    """GPUs per node (version 0.2). Default 1."""
    model_parallel_size: PositiveInt = 1
    """Model-parallel degree (version 0.2). Default 1."""


@dataclass(kw_only=True)
class ModelInfoConfig:
    """``autotuning.model_info``."""

    profile: bool = False
    """Profile the model to fill in the fields below. Default false."""
    num_params: NonNegInt | None = None
    """Number of parameters. Default null."""
    hidden_size: PositiveInt | None = None
    """Hidden size. Default null."""
    num_layers: PositiveInt | None = None
    """Number of layers. Default null."""


@dataclass(kw_only=True)
class AutotuningConfig:
    """``autotuning``: search ZeRO stage and micro-batch size (``deepspeed --autotuning``)."""

    enabled: bool = False
    """Run the autotuner. Default false."""
    fast: bool = True
    """Tune only the micro-batch size per ZeRO stage. Default true."""
    results_dir: str = "autotuning_results"
    """Where results go. Default "autotuning_results"."""
    exps_dir: str = "autotuning_exps"
    """Where experiment configs go. Default "autotuning_exps"."""
    overwrite: bool = True
    """Overwrite earlier results (DeepSpeed's code; its docs say false). Default true."""
    start_profile_step: PositiveInt = 3
    """First profiled step. Default 3."""
    end_profile_step: PositiveInt = 5
    """Last profiled step. Default 5."""
    metric: Literal["latency", "throughput", "flops"] = "throughput"
    """What to optimise. Default "throughput"."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """Search strategy (DeepSpeed's code; its docs say model_based). Default "gridsearch"."""
    tuner_early_stopping: PositiveInt = 5
    """Stop after this many experiments without improvement. Default 5."""
    tuner_num_trials: PositiveInt = 50
    """Most experiments per tuner. Default 50."""
    arg_mappings: dict[str, Any] | None = None
    """Config key -> script argument names to rewrite. Default null."""
    max_train_batch_size: PositiveInt | None = None
    """Largest global batch to try. Default null."""
    min_train_batch_size: PositiveInt = 1
    """Smallest global batch to try. Default 1."""
    max_train_micro_batch_size_per_gpu: PositiveInt = 1024
    """Largest micro-batch to try. Default 1024."""
    min_train_micro_batch_size_per_gpu: PositiveInt = 1
    """Smallest micro-batch to try. Default 1."""
    num_tuning_micro_batch_sizes: PositiveInt = 3
    """Micro-batch sizes tried per stage. Default 3."""
    mp_size: PositiveInt = 1
    """Model-parallel degree. Default 1."""
    model_info: ModelInfoConfig | None = None
    """Model facts for the model-based tuner. Default null."""


@dataclass(kw_only=True)
class PipelineConfig:
    """``pipeline``: options of the pipeline engine."""

    stages: PositiveInt | Literal["auto"] = "auto"
    """Pipeline stages; "auto" is DeepSpeed's own default here (taken from the PipelineModule). Default "auto"."""
    partition: str = "best"
    """Layer partitioning method: parameters, uniform, type:<regex>, best. Default "best"."""
    seed_layers: bool = False
    """Use a different seed per layer. Default false."""
    activation_checkpoint_interval: NonNegInt = 0
    """Checkpoint activations every this many layers; 0 = off. Default 0."""
    virtual_stages: PositiveInt | Literal["auto"] = "auto"
    """Model chunks per rank, run with the interleaved 1F1B schedule (beyond DeepSpeed); "auto" takes the
    PipelineModule's `virtual_stages` (default 1: plain 1F1B). Default "auto"."""
    pipe_partitioned: bool = True
    """Partition activations sent between stages over model-parallel ranks. Default true."""
    grad_partitioned: bool = True
    """Partition gradients sent between stages. Default true."""


@dataclass(kw_only=True)
class SparseAttentionConfig:
    """``sparse_attention``: block-sparse attention layouts (present = used, as in DeepSpeed)."""

    ACTIVE_WHEN_PRESENT: ClassVar[bool] = True

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    """Layout family. Default "fixed"."""
    block: PositiveInt = 16
    """Block size. Default 16."""
    different_layout_per_head: bool = False
    """Different layout per attention head. Default false."""
    num_local_blocks: PositiveInt = 4
    """Local window in blocks (fixed). Default 4."""
    num_global_blocks: PositiveInt = 1
    """Global blocks (fixed, bigbird). Default 1."""
    attention: Literal["bidirectional", "unidirectional"] = "bidirectional"
    """Attention direction. Default "bidirectional"."""
    horizontal_global_attention: bool = False
    """Global blocks also attend horizontally. Default false."""
    num_different_global_patterns: PositiveInt = 1
    """Distinct global patterns across heads. Default 1."""
    num_random_blocks: NonNegInt = 0
    """Random blocks per row (variable, bigbird). Default 0."""
    local_window_blocks: list[PositiveInt] = field(default_factory=lambda: [4])
    """Local window sizes in blocks (variable). Default [4]."""
    global_block_indices: list[NonNegInt] = field(default_factory=lambda: [0])
    """Global block indices (variable, bslongformer). Default [0]."""
    global_block_end_indices: list[NonNegInt] | None = None
    """Ends of global block ranges. Default null."""
    num_sliding_window_blocks: PositiveInt = 3
    """Sliding window in blocks (bigbird, bslongformer). Default 3."""


@dataclass(kw_only=True)
class HybridEngineConfig:
    """``hybrid_engine``: switch between training and fast generation (RLHF)."""

    enabled: bool = False
    """Use the hybrid engine. Default false."""
    max_out_tokens: PositiveInt = 512
    """Longest generation. Default 512."""
    inference_tp_size: PositiveInt = 1
    """Tensor-parallel degree for generation. Default 1."""
    release_inference_cache: bool = False
    """Free the KV cache after generation. Default false."""
    pin_parameters: bool = True
    """Pin gathered parameters. Default true."""
    tp_gather_partition_size: PositiveInt = 8
    """Partition size when gathering for tensor parallelism. Default 8."""


@dataclass(kw_only=True)
class ProgressiveLayerDropConfig:
    """``progressive_layer_drop``: skip transformer layers stochastically during training."""

    enabled: bool = False
    """Use progressive layer drop. Default false."""
    theta: float = 1.0
    """Keep-probability floor. Default 1.0."""
    gamma: float = 0.001
    """Decay rate of the keep-probability. Default 0.001."""


@dataclass(kw_only=True)
class EigenvalueConfig:
    """``eigenvalue``: estimate the Hessian's top eigenvalue per block (MoQ)."""

    enabled: bool = False
    """Compute eigenvalues. Default false."""
    verbose: bool = False
    """Print them. Default false."""
    max_iter: PositiveInt = 100
    """Power-iteration steps. Default 100."""
    tol: float = 0.01
    """Convergence tolerance. Default 1e-2."""
    stability: float = 1e-6
    """Numerical-stability epsilon. Default 1e-6."""
    gas_boundary_resolution: PositiveInt = 1
    """Compute every this many accumulation boundaries. Default 1."""
    layer_name: str = "bert.encoder.layer"
    """Module path of the layer list. Default "bert.encoder.layer"."""
    layer_num: NonNegInt = 0
    """Number of layers. Default 0."""


@dataclass(kw_only=True)
class CurriculumLearningConfig:
    """``curriculum_learning`` (legacy): sequence-length curriculum passed to forward."""

    enabled: bool = False
    """Use the curriculum. Default false."""
    curriculum_type: str = "seqlen"
    """What grows: "seqlen". Default "seqlen"."""
    min_difficulty: NonNegInt | None = None
    """Starting difficulty. Default null."""
    max_difficulty: NonNegInt | None = None
    """Final difficulty. Default null."""
    schedule_type: str | None = None
    """fixed_linear, fixed_root, fixed_discrete or custom. Default null."""
    schedule_config: dict[str, Any] = field(default_factory=dict)
    """Schedule parameters (total_curriculum_step, difficulty_step, ...). Default {}."""


@dataclass(kw_only=True)
class DataEfficiencyConfig:
    """``data_efficiency``: data sampling and routing (curriculum, random-LTD)."""

    enabled: bool = False
    """Use the data-efficiency library. Default false."""
    seed: int = 1234
    """Seed for data sampling. Default 1234."""
    data_routing: dict[str, Any] = field(default_factory=dict)
    """Data routing (random_ltd) options, passed through. Default {}."""
    data_sampling: dict[str, Any] = field(default_factory=dict)
    """Data sampling (curriculum) options, passed through. Default {}."""
