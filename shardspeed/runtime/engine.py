"""The training engine `initialize` returns: forward, backward, step and the counters, composed of parts.

The engine itself holds little logic. It owns the wrapped module and the counters, and delegates:
gradient averaging and the optimizer step to the stage's optimizer wrapper (`runtime/stage_wrappers.py`
builds it), loss scaling to `core/precision.py`, the module's dtypes to `core/module_dtypes.py`,
`torch_autocast` to `core/autocast.py`, `compile()` to `runtime/compiler.py`, `offload_states()` to
`zero/offload_states.py`, data to `runtime/data.py`, samples/s (`tput_timer`) to `runtime/throughput.py`,
checkpoints to `checkpoint/`, and DeepSpeed's config getters to `runtime/engine_getters.py`. See docs/architecture.md.

The resolved config is `engine.settings` (typed, `ShardspeedConfig`; DeepSpeed's private `engine._config`
is the same object, `engine.config` the dict as given). Parts are built from the blocks they need (the
`zero_optimization` block, the precision plan, the monitoring blocks, ...), never from the engine.

Attributes the engine does not have are looked up on the wrapped module, as DeepSpeed does
(`engine.config_class` reads `engine.module.config_class`); see `__getattr__`.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn

from shardspeed import accelerator
from shardspeed.compression.engine_part import CompressionSchedule
from shardspeed.config import ShardspeedConfig, resolve_batch_sizes
from shardspeed.core import memory, partitioned
from shardspeed.core.autocast import TorchAutocast
from shardspeed.core.module_dtypes import cast_module
from shardspeed.core.precision import PrecisionPlan
from shardspeed.core.usage_errors import EngineUsageError
from shardspeed.data_pipeline.engine_part import DataEfficiency
from shardspeed.moe.parallelism import ExpertParallelism
from shardspeed.monitor import MonitorMaster
from shardspeed.runtime.autotuning_probe import AutotuningProbe
from shardspeed.runtime.builders import resolve_lr_scheduler, resolve_optimizer
from shardspeed.runtime.compiler import ModuleCompiler
from shardspeed.runtime.data import ShardedDataLoader
from shardspeed.runtime.engine_checkpoint_files import CheckpointFiles
from shardspeed.runtime.engine_data_efficiency import DataEfficiencyMethods
from shardspeed.runtime.engine_extras import EngineExtras
from shardspeed.runtime.engine_getters import ConfigGetters
from shardspeed.runtime.engine_integrations import IntegrationMethods
from shardspeed.runtime.observers import StepObservers
from shardspeed.runtime.python_gc import ProcessSettings
from shardspeed.runtime.stage_wrappers import StageSettings, loader_steps_per_epoch, wrap_optimizer
from shardspeed.runtime.throughput import ThroughputTimer
from shardspeed.runtime.timers import PhaseTimers
from shardspeed.sequence.engine_part import SequenceParallelism
from shardspeed.utils.logging import log_dist
from shardspeed.utils.z3_leaf_module import apply_zero_leaf_module_config
from shardspeed.zero.offload_states import StateOffloader
from shardspeed.zero.zeropp import build_zeropp


def _broadcast_from_rank0(tensors: list[torch.Tensor], group) -> None:
    """Make every rank start from rank 0's values: one flat broadcast per dtype, not one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for same_dtype in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
        dist.broadcast(flat, src=src, group=group)
        pieces = flat.split([t.numel() for t in same_dtype])
        torch._foreach_copy_([t.data for t in same_dtype], [p.view_as(t) for p, t in zip(pieces, same_dtype)])


class ShardspeedEngine(
    ConfigGetters, IntegrationMethods, EngineExtras, DataEfficiencyMethods, CheckpointFiles, nn.Module
):
    """DeepSpeed's `DeepSpeedEngine` contract: call it, `backward(loss)`, `step()` every micro-batch."""

    def __init__(
        self,
        model: nn.Module,
        config: ShardspeedConfig,
        *,
        optimizer=None,
        model_parameters=None,
        training_data=None,
        lr_scheduler=None,
        mpu=None,
        collate_fn=None,
    ):
        super().__init__()
        self._config = config  # `settings` (engine_getters.py); DeepSpeed's private name, which scripts read
        self.config = config.raw  # DeepSpeed's `engine.config`: the config as given
        self.mpu = mpu
        self.process_settings = ProcessSettings(config)  # log_level, disable_python_gc
        # Gradients are averaged, and ZeRO shards, over every rank holding the same parameters: the data ranks,
        # and with sequence parallelism the sequence ranks too; batches are sharded over the data ranks only.
        self.dp_group = _replica_group(mpu)
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size(self.dp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        self.sequence = SequenceParallelism.from_mpu(mpu)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = accelerator.device_for_local_rank(self.local_rank)
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._in_no_sync = False
        self._step_applied = False
        self._window_loss = None

        self.plan = PrecisionPlan.from_config(config, sequence_parallel=self.sequence.enabled)
        if self.zero_optimization_stage() < 3:  # built under zero.Init: stages 0-2 keep full parameters
            for p in model.parameters():
                partitioned.materialize(p)
        self.module = model.to(device=self.device)
        cast_module(self.module, self.plan.param_dtype, config.data_types)
        apply_zero_leaf_module_config(self.module, config.zero_optimization.leaf_module)
        self.autocast = TorchAutocast.from_config(config, self.module, self.device)
        self.compiler = ModuleCompiler()
        # MoE layers: their expert groups are created here and experts start from their own group's values
        self.moe = ExpertParallelism.discover(
            self.module, mpu, self.dp_group, config.use_data_before_expert_parallelism,
            autoep=config.expert_parallel, zero_stage=self.zero_optimization_stage(),
            tp_size=config.tensor_parallel.autotp_size,
        )  # fmt: skip
        self.has_moe_layers = self.moe is not None  # DeepSpeed's attribute
        if self.moe is None:
            _broadcast_from_rank0(list(self.module.parameters()) + list(self.module.buffers()), self.dp_group)
        else:
            _broadcast_from_rank0(self.moe.replicated_tensors(), self.dp_group)
            self.moe.broadcast_experts(_broadcast_from_rank0)

        self.tput_timer = ThroughputTimer(  # DeepSpeed's attribute: samples/s, logged every steps_per_print
            config.timers.throughput, self.train_batch_size(), steps_per_output=config.steps_per_print,
            device=self.device,
        )  # fmt: skip
        # curriculum learning (legacy and data-efficiency sampling) and random-LTD (data_pipeline/)
        self.data_efficiency = DataEfficiency(
            config.data_efficiency, config.curriculum_learning, train_batch_size=self.train_batch_size(),
            module=self.module,
        )  # fmt: skip
        self.training_dataloader = (
            self._make_dataloader(training_data, collate_fn) if training_data is not None else None
        )
        if model_parameters is None:
            model_parameters = list(self.module.parameters())
        self.client_optimizer = optimizer  # what the script passed (`optimizer_name()` reports its class)
        client_optimizer = resolve_optimizer(optimizer, model_parameters, config)
        self.zeropp = build_zeropp(  # ZeRO++ (stage 3): node groups, quantized gathers and reduction
            config.zero_optimization, stage=self.zero_optimization_stage(), group=self.dp_group,
            module=self.module, moe=self.moe is not None,
        )  # fmt: skip
        self.optimizer = self._wrap_optimizer(client_optimizer) if client_optimizer is not None else None
        if self.optimizer is None and self.zero_optimization_stage() == 3:
            # ZeRO-3 inference (no optimizer, as Hugging Face's evaluation-only path runs it): the stage-3
            # wrapper still partitions the parameters and gathers them around each forward; its optimizer
            # never steps (backward and step refuse without a real one).
            self.optimizer = self._wrap_optimizer(_gather_only_optimizer(self.module))
            self.optimizer.coordinator.backward_follows = False  # so nothing is kept gathered for one
        self.basic_optimizer = client_optimizer
        # offload_states(): moves the wrapper's state; the ZeRO block says what already lives on the host
        # (none without an optimizer: DeepSpeed refuses to move states there too)
        self.states = StateOffloader(
            self.optimizer if client_optimizer is not None else None, self.device, config.zero_optimization
        )
        if client_optimizer is not None and hasattr(self.optimizer, "state_offloader"):
            self.optimizer.state_offloader = self.states  # optimizer.offload_states() is the engine's
        self.lr_scheduler = resolve_lr_scheduler(lr_scheduler, client_optimizer, config)

        # the flops profiler reports backward and step latency, so it turns the timers on (as in DeepSpeed)
        # and so does an autotuning experiment, which measures them (as in DeepSpeed)
        self.timers = PhaseTimers(
            self.device,
            config.wall_clock_breakdown or config.flops_profiler.enabled or config.autotuning.enabled,
        )
        self.monitor = MonitorMaster(config, self.global_rank)  # DeepSpeed's attribute
        # an autotuning experiment measures the profiled steps, writes the metrics and ends the run
        probe = None
        if config.autotuning.enabled:
            probe = AutotuningProbe(
                config.autotuning, timers=self.timers, rank=self.global_rank,
                train_batch_size=self.train_batch_size(),
                gradient_accumulation_steps=self.gradient_accumulation_steps(), module=self.module,
            )  # fmt: skip
        self.observers = StepObservers(  # monitors, flops profiler, comms logger, autotuning probe
            self.monitor, config.flops_profiler, config.comms_logger, timers=self.timers, module=self.module,
            rank=self.global_rank, profiled_engine=self, autotuning=probe,
        )  # fmt: skip
        self.compression = CompressionSchedule(self.module, config)  # compression_training's schedule
        self.compression_scheduler = self.compression.scheduler  # DeepSpeed's attribute
        if self.global_rank == 0:
            log_dist(
                f"engine ready: world_size={self.world_size} zero_stage={self.zero_optimization_stage()} "
                f"dtype={self.plan.param_dtype} micro_batch={self.train_micro_batch_size_per_gpu()} "
                f"grad_accum={self.gradient_accumulation_steps()} train_batch={self.train_batch_size()}"
            )
            if config.dump_state:
                log_dist(
                    "engine config (every key resolved):\n"
                    + json.dumps(config.to_dict(), indent=2, default=str)
                )

    # -- construction helpers ------------------------------------------------------------------------------

    def _make_dataloader(self, dataset, collate_fn):
        """The `training_data` loader (DeepSpeed's `deepspeed_io(training_data)`): shuffled, or the curriculum
        sampler's batches when curriculum sampling is on; fetching each batch starts the throughput timer's
        micro-step."""
        curriculum = self._curriculum_loader(dataset, collate_fn)
        if curriculum is not None:
            return curriculum
        return self._sharded_loader(dataset, collate_fn=collate_fn, tput_timer=self.tput_timer)

    def _curriculum_loader(self, dataset, collate_fn):
        """The curriculum sampler's loader of `dataset` (None when curriculum sampling is off)."""
        loader = self.data_efficiency.training_loader(
            dataset, micro_batch_size=self.train_micro_batch_size_per_gpu(),
            dp_rank=self.sequence.data_rank(self.dp_rank),
            dp_world_size=self.sequence.data_world_size(self.world_size), dp_group=self.dp_group,
            gradient_accumulation_steps=self.gradient_accumulation_steps(), global_rank=self.global_rank,
            drop_last=self._config.dataloader_drop_last, collate_fn=collate_fn, tput_timer=self.tput_timer,
        )  # fmt: skip
        return self.sequence.shard_loader(loader) if loader is not None else None

    def deepspeed_io(self, dataset, batch_size=None, route="train", pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):  # fmt: skip
        """Build a data loader for `dataset` sharded over the data-parallel ranks (DeepSpeed's name); on the
        training route with curriculum sampling on, the curriculum sampler's loader, as in DeepSpeed."""
        if route == "train" and self.curriculum_learning_enabled():
            if data_sampler is not None or batch_size not in (None, self.train_micro_batch_size_per_gpu()):
                raise ValueError(
                    "deepspeed_io: with curriculum sampling on, the training route's sampler is the curriculum's "
                    "and its batch is train_micro_batch_size_per_gpu; data_sampler and batch_size cannot change it"
                )
            return self._curriculum_loader(dataset, collate_fn)
        return self._sharded_loader(
            dataset, batch_size=batch_size, collate_fn=collate_fn, shuffle=route == "train",
            num_workers=num_local_io_workers or 0, pin_memory=pin_memory, data_sampler=data_sampler,
            tput_timer=self.tput_timer if route == "train" else None,  # as DeepSpeed: only training is timed
        )  # fmt: skip

    def _sharded_loader(self, dataset, batch_size=None, **options):
        """A `ShardedDataLoader` over this engine's data-parallel ranks (runtime/data.py has the order)."""
        return self.sequence.shard_loader(
            ShardedDataLoader(
                dataset,
                batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                num_replicas=self.sequence.data_world_size(self.world_size),
                rank=self.sequence.data_rank(self.dp_rank),
                drop_last=self._config.dataloader_drop_last,
                **options,
            )
        )

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer):
        """Wrap the torch optimizer in the stage's wrapper, which owns gradients, masters and the step."""
        return wrap_optimizer(
            self.module, optimizer, StageSettings.from_config(self._config), plan=self.plan,
            group=self.dp_group, moe=self.moe, zeropp=self.zeropp,
            steps_per_epoch=loader_steps_per_epoch(self.training_dataloader, self.gradient_accumulation_steps()),
        )  # fmt: skip

    # -- the training loop ---------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        self.states.check_resident("forward")
        self.tput_timer.start_at_forward()
        self.timers.start("forward")
        self.observers.before_forward(self.global_steps)
        self.compression.before_forward(self.global_steps)
        kwargs = self.data_efficiency.forward_kwargs(kwargs, self.global_steps, self.module.training)
        if self._config.fp16.enabled and self._config.fp16.auto_cast:
            inputs, kwargs = _cast_floating((inputs, kwargs), torch.float16)
        with self.autocast.context():
            out = self.module(*inputs, **kwargs)
        self.observers.after_forward()
        self.timers.stop("forward")
        return out

    def backward(self, loss: torch.Tensor, release_loss: bool = False, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:  # fmt: skip
        """Backpropagate `loss / gradient_accumulation_steps`; gradients are averaged at the boundary.

        Returns the loss divided by the accumulation steps, in the loss's own dtype (a bf16 model's loss
        stays bf16), as DeepSpeed 0.19 does.
        """
        if self.basic_optimizer is None:
            raise RuntimeError(
                "engine.backward needs an optimizer: pass one to initialize() or configure 'optimizer'"
            )
        self.states.check_resident("backward")
        self.timers.start("backward")
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        detached = loss.detach()
        self._window_loss = detached if self._window_loss is None else self._window_loss + detached
        self.optimizer.backward_begin(self.is_gradient_accumulation_boundary() and not self._in_no_sync)
        with self.compiler.backward_context():
            self.optimizer.scaler.scale_loss(loss).backward(retain_graph=retain_graph)
        self.optimizer.backward_end()
        self.timers.stop("backward")
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call once per micro-batch; the optimizer runs at the accumulation boundary."""
        if self.basic_optimizer is None:
            raise RuntimeError(
                "engine.step needs an optimizer: pass one to initialize() or configure 'optimizer'"
            )
        if self._in_no_sync:
            raise EngineUsageError(
                "It is illegal to call Engine.step() inside no_sync context manager: gradients were not "
                "averaged across ranks; leave engine.no_sync() first"
            )
        self.states.check_resident("step")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self.timers.start("step")
            self._optimizer_step(lr_kwargs, "gradient overflow (inf/nan): step skipped")
            self.timers.stop("step")
            self.observers.after_step(
                self.global_steps, self.global_samples, self._window_loss, self.get_lr(),
                self.loss_scale() if self.fp16_enabled() else None,
            )  # fmt: skip
            self._report_progress()
        self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)
        self.micro_steps += 1
        if boundary:
            self.observers.step_finished(self.global_steps)  # the autotuning probe may end the run here

    def _optimizer_step(self, lr_kwargs: dict | None, overflow_message: str) -> None:
        """The boundary step and its bookkeeping (the pipeline engine's OptimizerStep instruction too)."""
        self._step_applied = self.optimizer.step()
        if self._step_applied:
            self.compression.after_step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
            log_dist(f"{overflow_message}, loss scale is now {self.optimizer.loss_scale}")
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _report_progress(self) -> None:
        every = self._config.steps_per_print
        loss, self._window_loss = self._window_loss, None
        if self._config.memory_breakdown and self.global_rank == 0:  # every step, as DeepSpeed's breakdown
            log_dist(f"memory at step {self.global_steps} (bytes on rank 0): {self.memory_breakdown()}")
        if not every or self.global_steps % every != 0 or self.global_rank != 0:
            return
        parts = [
            f"step={self.global_steps}",
            f"skipped={self.skipped_steps}",
            f"lr={[round(lr, 8) for lr in self.get_lr()]}",
            f"loss={loss.item():.4f}" if loss is not None else "",
            f"loss_scale={self.optimizer.loss_scale:g}" if self.fp16_enabled() else "",
            self.timers.report() if self.timers.enabled else "",
        ]
        log_dist(" ".join(p for p in parts if p))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally without averaging them across ranks."""
        if self.zero_optimization_stage() >= 2:
            raise EngineUsageError(
                "no_sync context manager is incompatible with ZeRO stage 2 or 3 (gradients are partitioned "
                "as they are reduced); use gradient_accumulation_steps instead"
            )
        if self._in_no_sync:
            raise EngineUsageError(
                "no_sync context manager reentry is unsupported: no_sync() is already active"
            )
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def was_step_applied(self) -> bool:
        return self._step_applied

    # -- checkpoints (implemented in shardspeed/checkpoint over the parts of runtime/engine_parts.py) -------

    def checkpoint_parts(self) -> list:
        """The parts a checkpoint saves and loads, each under its own name (checkpoint/parts.py); made at the
        first save or load, once `initialize` has attached every part (tensor parallelism attaches last)."""
        if self.__dict__.get("_checkpoint_parts") is None:  # not getattr: that would ask the wrapped module
            self._checkpoint_parts = self._make_checkpoint_parts()
        return self._checkpoint_parts

    def _make_checkpoint_parts(self) -> list:
        from shardspeed.runtime.engine_parts import checkpoint_parts

        return checkpoint_parts(self)

    def _checkpoint_placement(self):
        from shardspeed.runtime.engine_parts import placement

        return placement(self)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False) -> bool:  # fmt: skip
        from shardspeed.checkpoint.engine_io import SaveSettings, save_checkpoint
        from shardspeed.checkpoint.parts import SaveOptions

        parts = self.checkpoint_parts()
        settings = SaveSettings(
            self._checkpoint_placement(),
            f"global_step{self.global_steps}",
            self._config.checkpoint.tag_validation,
        )
        options = SaveOptions(exclude_frozen=exclude_frozen_parameters)
        saved = save_checkpoint(parts, settings, save_dir, tag, client_state or {}, save_latest, options)
        if self.global_rank == 0 and self.zero_optimization_stage() > 0 and self.basic_optimizer is not None:
            self._copy_recovery_script(save_dir)  # beside the tags, as DeepSpeed leaves its zero_to_fp32.py
        return saved

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):  # fmt: skip
        from shardspeed.checkpoint.engine_io import load_checkpoint
        from shardspeed.checkpoint.parts import LoadOptions

        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported")
        parts = self.checkpoint_parts()
        options = LoadOptions(
            load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only,
            universal=self._config.checkpoint.load_universal,
        )  # fmt: skip
        return load_checkpoint(parts, self._checkpoint_placement(), load_dir, tag, options)

    def save_16bit_model(
        self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        """Rank 0 writes the module's weights in the training dtype (collective; see checkpoint/export.py)."""
        from shardspeed.checkpoint.export import save_16bit_model
        from shardspeed.runtime.engine_parts import weights_source

        return save_16bit_model(weights_source(self), save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

    # -- getters DeepSpeed users call ----------------------------------------------------------------------

    def get_batch_info(self):
        return self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        micro, world = self.train_micro_batch_size_per_gpu(), self.sequence.data_world_size(self.world_size)
        if train_batch_size % (micro * world) != 0:
            raise ValueError(
                f"train_batch_size {train_batch_size} is not divisible by train_micro_batch_size_per_gpu "
                f"({micro}) * data-parallel size ({world})"
            )
        gas = train_batch_size // (micro * world)
        self._set_batch(train_batch_size, micro, gas)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        gas = self.gradient_accumulation_steps()
        world = self.sequence.data_world_size(self.world_size)
        self._set_batch(micro_batch_size * gas * world, micro_batch_size, gas)

    def _set_batch(self, train: int, micro: int, gas: int) -> None:
        train, micro, gas = resolve_batch_sizes(
            train, micro, gas, self.sequence.data_world_size(self.world_size)
        )
        self._config.train_batch_size = train
        self._config.train_micro_batch_size_per_gpu = micro
        self._config.gradient_accumulation_steps = gas
        self.tput_timer.batch_size = train  # samples/s counts the new global batch from the next step

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.basic_optimizer.param_groups] if self.basic_optimizer else []

    def get_mom(self) -> list:
        groups = self.basic_optimizer.param_groups if self.basic_optimizer else []
        return [g.get("momentum", g.get("betas")) for g in groups]

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.grad_norm if self.optimizer is not None else None

    def get_sequence_parallel_group(self):
        """The Ulysses sequence-parallel group for DistributedAttention (None without sequence parallelism)."""
        return self.sequence.group

    def loss_scale(self) -> float:
        return self.optimizer.loss_scale if self.optimizer is not None else 1.0

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of parameters, gradients, fp32 masters, optimizer state and buffers on this rank."""
        return memory.measure(self.module, self.optimizer).as_dict()

    def destroy(self) -> None:
        """Remove gradient hooks so the module can be used (or wrapped again) without this engine, and delete
        NVMe optimizer-offload swap files; close the monitors' files; give back `disable_python_gc`."""
        self.observers.close()
        if self.optimizer is not None:
            self.optimizer.remove_hooks()
            if hasattr(self.optimizer, "close_offload"):
                self.optimizer.close_offload()
        self.process_settings.release()


def _replica_group(mpu):
    """The group over which parameters are replicated (None: the world)."""
    if mpu is None:
        return None
    if hasattr(mpu, "get_sequence_data_parallel_group"):
        return mpu.get_sequence_data_parallel_group()
    return mpu.get_data_parallel_group()


def _cast_floating(obj, dtype: torch.dtype):
    """Cast every floating tensor inside nested tuples/lists/dicts to `dtype` (fp16 `auto_cast`)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def _gather_only_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """A torch optimizer that never steps, over the trainable parameters (a zero-size stand-in when there are
    none): what the ZeRO-3 wrapper is built around when there is no optimizer."""
    params = [p for p in module.parameters() if p.requires_grad] or [nn.Parameter(torch.zeros(0))]
    return torch.optim.Adam(params, lr=0.0)  # its state is made at the first step, which never comes
