"""Config blocks of features beyond the training core (reference §2.6, §2.7, §2.10, §2.12-§2.14).

Defaults are DeepSpeed 0.19.8's code defaults. Blocks of features shardspeed does not implement are typed
here too, so that a config using them is refused naming the key (``implemented.py``), not as unknown.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from .blocks import NonNegInt, PositiveInt
from .build import Key, join
from .errors import ConfigError

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "AutotuningConfig",
    "CompileConfig",
    "ExpertParallelConfig",
    "HybridEngineConfig",
    "ModelInfoConfig",
    "PipelineConfig",
    "WeightQuantizationConfig",
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
    """``autotuning``: search ZeRO stage, offload and micro-batch size (``deepspeed --autotuning tune|run``).

    Read by two parties: the autotuner (shardspeed/autotuning), which runs one short training per candidate
    config, and the engine of each such run, which measures the steps from ``start_profile_step`` to
    ``end_profile_step``, writes the metrics to ``metric_path`` and ends the process (``enabled``)."""

    enabled: bool = False
    """Profile this run: write the metrics after end_profile_step, then exit. Default false."""
    fast: bool = True
    """Tune only the micro-batch size per ZeRO stage (false: then also the stage's ZeRO knobs). Default true."""
    results_dir: str = "autotuning_results"
    """Where results go. Default "autotuning_results"."""
    exps_dir: str = "autotuning_exps"
    """Where experiment configs go. Default "autotuning_exps"."""
    overwrite: bool = True
    """Start from empty folders; false keeps finished experiments and skips them (DeepSpeed's code; its docs
    say false). Default true."""
    start_profile_step: NonNegInt = 3
    """First measured optimizer step (0-based; earlier steps warm up). Default 3."""
    end_profile_step: NonNegInt = 5
    """Last measured optimizer step; the run ends after it. Default 5."""
    metric: Literal["latency", "throughput", "flops"] = "throughput"
    """What to optimise: latency is minimised, throughput and flops maximised. Default "throughput"."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """Search order (DeepSpeed's code; its docs say model_based, which is refused: no cost model is built).
    Default "gridsearch"."""
    tuner_early_stopping: PositiveInt = 5
    """Stop a tuning space after this many experiments without a better metric. Default 5."""
    tuner_num_trials: PositiveInt = 50
    """Most experiments per tuning space. Default 50."""
    arg_mappings: dict[str, str] | None = None
    """Config key -> script argument to rewrite with each experiment's value (e.g.
    {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}). Default null."""
    max_train_batch_size: PositiveInt | None = None
    """Global batch every experiment keeps: accumulation steps = this / (micro-batch x data ranks), and no
    larger micro-batch is tried. Default null (the config's accumulation steps)."""
    min_train_batch_size: PositiveInt = 1
    """Smallest global batch to try. Default 1."""
    max_train_micro_batch_size_per_gpu: PositiveInt = 1024
    """Largest micro-batch to try. Default 1024."""
    min_train_micro_batch_size_per_gpu: PositiveInt = 1
    """Smallest micro-batch to try. Default 1."""
    num_tuning_micro_batch_sizes: PositiveInt = 3
    """Micro-batch sizes tried below the largest that runs, at its global batch. Default 3."""
    mp_size: PositiveInt = 1
    """Model-parallel degree (divides the global batch). Default 1."""
    model_info: ModelInfoConfig | None = None
    """Model facts for DeepSpeed's memory estimate: refused (micro-batch sizes are found by running them).
    Default null."""
    metric_path: str | None = None
    """Where this run writes its metrics (null: ./autotuning_metric.json). Default null."""
    model_info_path: str | None = None
    """Where DeepSpeed's model-info profile run writes: refused, as model_info. Default null."""
    experiment_timeout: PositiveInt = 1800
    """Seconds one experiment may run before it is stopped and recorded as failed (beyond DeepSpeed, whose
    experiments have no time limit). Default 1800."""

    def validate(self, path: str) -> None:
        if self.tuner_type == "model_based":
            raise ConfigError(
                f'{join(path, "tuner_type")}: "model_based" is not supported by shardspeed (its XGBoost cost '
                'model is not built); use "gridsearch" or "random"'
            )
        self._refuse_model_info(path)
        if self.end_profile_step < self.start_profile_step:
            raise ConfigError(
                f"{join(path, 'end_profile_step')}: {self.end_profile_step} is before "
                f"{join(path, 'start_profile_step')} {self.start_profile_step}"
            )
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ConfigError(
                f"{join(path, 'max_train_micro_batch_size_per_gpu')}: {self.max_train_micro_batch_size_per_gpu} "
                f"is below {join(path, 'min_train_micro_batch_size_per_gpu')} "
                f"{self.min_train_micro_batch_size_per_gpu}"
            )
        for name in ("results_dir", "exps_dir"):
            if not getattr(self, name):
                raise ConfigError(f"{join(path, name)}: must not be empty")
        for key, arg in (self.arg_mappings or {}).items():
            if not isinstance(arg, str):
                raise ConfigError(
                    f"{join(path, 'arg_mappings')}.{key}: expected the script argument's name (a string), got "
                    f"{arg!r}"
                )
            if not key.strip() or not arg.strip():
                raise ConfigError(
                    f"{join(path, 'arg_mappings')}: {key!r}: {arg!r}: neither the config key nor the script "
                    "argument may be empty"
                )

    def _refuse_model_info(self, path: str) -> None:
        reason = (
            "is not supported by shardspeed (the model-info profile run and its memory estimate are not built: "
            "micro-batch sizes are found by running them); remove the key"
        )
        if self.model_info_path is not None:
            raise ConfigError(f"{join(path, 'model_info_path')}: {reason}")
        if self.model_info is not None:
            info = self.model_info
            set_keys = [
                join(path, f"model_info.{f.name}")
                for f in dataclasses.fields(info)
                if getattr(info, f.name) != f.default
            ]
            setting = f" (it sets {', '.join(set_keys)})" if set_keys else ""
            raise ConfigError(f"{join(path, 'model_info')}: {reason}{setting}")


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
    use_reentrant: bool | None = None
    """DeepSpeed's choice of checkpoint function for `activation_checkpoint_interval`: false sets the
    PipelineModule's function to `checkpointing.non_reentrant_checkpoint` (as DeepSpeed does), which is also
    shardspeed's default; true (DeepSpeed's default) is refused: pass a reentrant function as
    `activation_checkpoint_func` instead. Default null."""

    def validate(self, path: str) -> None:
        if self.use_reentrant:
            raise ConfigError(
                f"{join(path, 'use_reentrant')}: true is not supported by shardspeed (pipeline activation "
                "checkpointing uses checkpointing.non_reentrant_checkpoint unless the PipelineModule is given "
                "another activation_checkpoint_func); remove the key or set it false"
            )


@dataclass(kw_only=True)
class HybridEngineConfig:
    """``hybrid_engine``: one engine that trains and generates (RLHF actors; runtime/hybrid_engine.py).

    ``generate`` gathers a ZeRO-3 model once per call (or, with ``inference_tp_size`` > 1, splits it into
    tensor-parallel shards) and decodes on the inference package's KV-cache path. What DeepSpeed does with
    its inference kernels that has no counterpart here is refused by name (see ``validate``)."""

    enabled: bool = False
    """``deepspeed.initialize`` returns the hybrid engine (``DeepSpeedHybridEngine``). Default false."""
    max_out_tokens: PositiveInt = 512
    """Tokens one generated sequence may hold, prompt included: the KV cache's length; a longer request is
    refused naming this key. Default 512."""
    inference_tp_size: PositiveInt = 1
    """Tensor-parallel degree of generation. 1: every data-parallel rank generates its own batch with the
    whole (gathered) model. Above 1 (ZeRO-3, pinned parameters, a Llama-layout model): groups of this many
    consecutive ranks each hold their tensor-parallel shard of the layers and decode their prompts together.
    Default 1."""
    release_inference_cache: bool = False
    """Free the KV cache after every ``generate`` (true), or keep it for the next call of the same batch
    size (false: no re-allocation per rollout). Default false."""
    pin_parameters: bool = True
    """ZeRO-3: gather every parameter once per ``generate`` and keep it for the whole call (true), or
    gather layer by layer for every token through the model's own ``generate`` (false: the memory of one
    layer at a time, one gather per layer per token). Default true."""
    tp_gather_partition_size: PositiveInt = 8
    """Layers gathered together while splitting them for ``inference_tp_size`` > 1 (fewer: less memory
    whole at once, more gathers); read only then. Default 8."""
    enable_cuda_graph: bool = False
    """Capture decode steps in CUDA graphs; only false (not built). Default false."""

    def validate(self, path: str) -> None:
        if self.tp_gather_partition_size != 8 and self.inference_tp_size == 1:
            raise ConfigError(
                f"{join(path, 'tp_gather_partition_size')}: {self.tp_gather_partition_size} has no effect with "
                "inference_tp_size 1 (it sizes the layer groups split for tensor-parallel generation); set "
                "inference_tp_size above 1 or remove the key"
            )
        if self.enable_cuda_graph:
            raise ConfigError(
                f"{join(path, 'enable_cuda_graph')}: true is not supported by shardspeed (decode steps are "
                "not captured in CUDA graphs); remove the key or set it false"
            )


@dataclass(kw_only=True)
class CompileConfig:
    """``compile``: DeepSpeed 0.19's DeepCompile options. ``engine.compile()`` (torch.compile of the module)
    needs none of them; every key here is a DeepCompile pass or option."""

    deepcompile: bool = False
    """Compile with DeepSpeed's own graph passes (ZeRO inside the compiled graph). Default false."""
    autoep_non_moe: bool = False
    """Compile the parents of AutoEP layers, keeping AutoEP eager. Default false."""
    free_activation: bool = False
    """Free activations eagerly. Default false."""
    free_activation_threshold: NonNegInt = 10 * 2**20
    """Bytes from which activations are freed eagerly. Default 10 MiB."""
    offload_activation: bool = False
    """Move saved activations to host memory between forward and backward. Default false."""
    offload_activation_pin_memory: bool = True
    """Pin the host buffers of offload_activation. Default true."""
    offload_opt_states: bool = False
    """Offload optimizer state to host memory during forward/backward. Default false."""
    double_buffer: bool = True
    """Double-buffer parameter gathers. Default true."""
    symmetric_memory: bool = False
    """Use symmetric memory. Default false."""
    debug_log: bool = False
    """Dump graphs. Default false."""
    offload_parameters: bool = False
    """Offload parameters. Default false."""
    sync_before_reduce: bool = False
    """Synchronise before each reduction. Default false."""
    sync_after_reduce: bool = False
    """Synchronise after each reduction. Default false."""
    sync_before_allgather: bool = False
    """Synchronise before each all-gather. Default false."""
    sync_after_allgather: bool = False
    """Synchronise after each all-gather. Default false."""
    keep_int_input_tensors: bool = True
    """Keep real values of integer inputs when recording. Default true."""
    keep_all_input_tensors: bool = False
    """Keep real values of all inputs when recording. Default false."""
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None
    """DeepCompile passes to compose. Default null."""


@dataclass(kw_only=True)
class ExpertParallelConfig:
    """``expert_parallel``: DeepSpeed 0.19's AutoEP (automatic expert parallelism of Hugging Face MoE models).

    Only ``enabled`` is typed here; the block's other keys (``autoep_size``, ``preset_model``, ...) are parsed and
    checked by shardspeed.moe.autoep when the engine starts (an unknown key or unsupported value is refused
    there, naming it). See docs/compatibility.md ("AutoEP")."""

    EXTRA_KEYS_FIELD: ClassVar[str] = "options"

    enabled: bool = False
    """Replace the model's MoE layers with AutoEP layers. Default false."""
    options: dict[str, Any] = field(default_factory=dict)
    """Every other key of the block (DeepSpeed's names and defaults; checked when the engine starts)."""


@dataclass(kw_only=True)
class WeightQuantizationConfig:
    """``weight_quantization``: quantized weights at zero.Init / after initialisation (on when present)."""

    enabled: bool = True
    """Quantize. Default true (the block's presence turns it on, as in DeepSpeed)."""
    num_bits: PositiveInt = 8
    """Bits per weight. Default 8."""
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    """Quantization type. Default "symmetric"."""
    q_groups: PositiveInt = 1
    """Quantization groups. Default 1."""
    quantized_initialization: dict[str, Any] = field(default_factory=dict)
    """Quantize at zero.Init. Default {}."""
    post_init_quant: dict[str, Any] = field(default_factory=dict)
    """Quantize after initialisation. Default {}."""
