"""`PipelineEngine`: what `initialize(model=PipelineModule(...))` returns; trains with `train_batch()`.

The engine is the ordinary `ShardspeedEngine` (precision, optimizer wrapper, LR schedule, counters, data
loader) built over this stage's layers and this stage's data-parallel group, plus a schedule executor:
`train_batch` runs a `TrainSchedule` instruction list (pipe/schedule.py), exchanging activations and
gradients with the neighbouring stages (pipe/p2p.py). With `pipeline.virtual_stages` v > 1 (or a module built
with `virtual_stages=v`) each rank holds v model chunks and runs the interleaved schedule; buffers are keyed by
(micro-batch, chunk) and there is one link per part boundary this rank touches.

Gradients accumulate locally over all micro-batches (the wrapper's reduction is switched off during the
schedule). After the last backward, tied weights' gradients are summed over the stages holding them, then
the wrapper averages every gradient over the stage's data-parallel replicas — one reduction per batch, as
DeepSpeed. The optimizer step combines the stages' gradient norms into the global norm (tied copies counted
once), so clipping sees the whole model and an fp16 overflow on any stage skips the step on all of them.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist

from shardspeed.checkpointing import non_reentrant_checkpoint
from shardspeed.config import ConfigError
from shardspeed.data_pipeline.engine_part import refuse_for_pipeline
from shardspeed.pipe import schedule as sched
from shardspeed.pipe.module import PipelineModule
from shardspeed.pipe.p2p import Link
from shardspeed.runtime.data import RepeatingLoader
from shardspeed.runtime.engine import ShardspeedEngine
from shardspeed.utils.logging import log_dist

__all__ = ["PipelineEngine", "PipelineError"]


def _requiring_grad(inputs):
    """The first stage's inputs with every floating-point tensor made a leaf that requires grad."""
    if isinstance(inputs, tuple | list):
        values = [_requiring_grad(x) for x in inputs]
        return values if isinstance(inputs, list) else tuple(values)
    if torch.is_tensor(inputs) and inputs.is_floating_point():
        return inputs.detach().requires_grad_()
    return inputs


class PipelineError(Exception):
    """Misuse of the pipeline engine (DeepSpeed's name)."""


def _apply_pipeline_config(block, model: PipelineModule) -> None:
    """The `pipeline` config block. As in DeepSpeed the module is built before the engine sees the config, so
    `stages`, `partition` and `seed_layers` can only confirm the module's own arguments (a contradiction is an
    error naming the key); `activation_checkpoint_interval` > 0 overrides the module's, as DeepSpeed's does."""
    if block.stages != "auto" and block.stages != model.num_stages:
        raise ConfigError(
            f"pipeline.stages: {block.stages}, but the PipelineModule was built with {model.num_stages} stages"
        )
    if block.partition != "best" and block.partition.lower() != model.partition_method.lower():
        raise ConfigError(
            f"pipeline.partition: {block.partition!r}, but the PipelineModule was partitioned with "
            f"{model.partition_method!r} (pass partition_method= to PipelineModule)"
        )
    if block.seed_layers and not model.seed_layers:
        raise ConfigError(
            "pipeline.seed_layers: true, but the PipelineModule was built with seed_layers=False"
        )
    if block.use_reentrant is False:  # as DeepSpeed: the config's choice replaces the module's function
        model.activation_checkpoint_func = non_reentrant_checkpoint
    if block.activation_checkpoint_interval > 0:
        model.set_checkpoint_interval(block.activation_checkpoint_interval)
    virtual = model.virtual_stages if block.virtual_stages == "auto" else block.virtual_stages
    if virtual > 1 and model.num_stages == 1:
        raise ConfigError(
            f"pipeline.virtual_stages: {virtual} needs at least 2 pipeline stages (the module has 1)"
        )
    model.set_virtual_stages(virtual)  # rebuilds this rank's layers when the count changes


def _rebuilt_parameters(given, before: list, model: PipelineModule) -> list:
    """`initialize(model_parameters=...)` listed the module's parameters before `pipeline.virtual_stages`
    rebuilt its layers: take the rebuilt ones. Anything else cannot be mapped to the new layers."""
    given = list(given)
    if len(given) == len(before) and all(a is b for a, b in zip(given, before)):
        return list(model.parameters())
    raise ConfigError(
        "pipeline.virtual_stages rebuilt the PipelineModule's layers, so the model_parameters given to "
        "initialize() no longer belong to it; pass virtual_stages= to PipelineModule instead, or omit "
        "model_parameters"
    )


class _BatchState:
    """Per-batch buffers of the schedule executor, keyed by (micro-batch, chunk)."""

    def __init__(self, batches):
        self.batches = batches
        self.inputs: dict = {}
        self.labels: dict = {}
        self.outputs: dict = {}
        self.out_grads: dict = {}
        self.losses: list[torch.Tensor] = []
        self.additional: dict[
            str, list[torch.Tensor]
        ] = {}  # the module's get_additional_losses(), per micro-batch
        self.last_output = None
        self.compute_loss = True

    def add_additional(self, losses: dict) -> None:
        for name, value in losses.items():
            if not torch.is_tensor(value):
                raise PipelineError(
                    f"get_additional_losses()[{name!r}] is {type(value).__name__}; each additional loss must be a "
                    "tensor"
                )
            self.additional.setdefault(name, []).append(value.detach().float().mean())


class PipelineEngine(ShardspeedEngine):
    """DeepSpeed's `PipelineEngine`: `train_batch`, `eval_batch`; direct forward/backward/step raise."""

    def __init__(self, model: PipelineModule, config, **kwargs):
        if config.zero_optimization.stage >= 2:
            raise ConfigError(
                f"zero_optimization.stage: {config.zero_optimization.stage} is incompatible with pipeline "
                "parallelism (a stage's gradients are reduced once per batch); use stage 0 or 1"
            )
        if kwargs.get("mpu") is not None:
            raise ValueError(
                "initialize(mpu=...) cannot be combined with a PipelineModule; its topology is used"
            )
        refuse_for_pipeline(config)  # curriculum and random-LTD need the ordinary engine's forward and loader
        before = list(model.parameters())
        _apply_pipeline_config(config.pipeline, model)
        rebuilt = [id(p) for p in before] != [id(p) for p in model.parameters()]
        if rebuilt and kwargs.get("model_parameters") is not None:
            kwargs["model_parameters"] = _rebuilt_parameters(kwargs["model_parameters"], before, model)
        kwargs["mpu"] = model.mpu()
        super().__init__(model, config, **kwargs)
        self.grid = model.mpu()
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self.tied = model.tied
        self.chunks = model.virtual_stages
        if self.chunks > 1 and self.gradient_accumulation_steps() % self.num_stages:
            raise ConfigError(
                f"pipeline.virtual_stages: {self.chunks} (interleaved schedule) needs gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps()}) to be a multiple of the pipeline stages ({self.num_stages})"
            )
        self.links = self._make_links()
        self.pipe_group = self.grid.get_pipe_parallel_group()
        self.data_iterator = None
        self.batch_fn = None
        self.agg_additional_losses = None  # get_additional_losses(): the last train_batch's, on every stage
        if self.training_dataloader is not None:
            # as DeepSpeed: training_data never runs dry, the next epoch follows the last (in the same order)
            self.set_dataloader(RepeatingLoader(self.training_dataloader))
        if self.optimizer is not None:
            self.optimizer.global_norm_hook = self._pipeline_norm
            reducer = getattr(self.optimizer, "reducer", None) or self.optimizer.grads
            self._grad_reducer = reducer
            self._grad_view = {p: v for b in reducer.buckets for p, v in zip(b.params, b.views)}
        log_dist(f"pipeline engine: stages={self.num_stages} partition={model.parts} micro_batches="
                 f"{self.gradient_accumulation_steps()}")  # fmt: skip

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                               z3_params_to_fetch=None, allowed_missing_keys=None) -> None:  # fmt: skip
        """The engine's, for a checkpoint whose `module` is a state dict. DeepSpeed's pipeline engine also
        takes `module` None (its layer files, read from the folder being loaded); here `load_checkpoint` reads
        those, so that form is refused."""
        if custom_load_fn is not None:
            raise ValueError(
                "custom_load_fn is not supported with pipeline parallelism (DeepSpeed refuses it too)"
            )
        if not isinstance(checkpoint.get("module"), dict):
            raise NotImplementedError(
                "PipelineEngine.load_module_state_dict: the checkpoint holds no module state dict (a pipeline "
                "checkpoint keeps its weights in layer files); load it with load_checkpoint"
            )
        super().load_module_state_dict(checkpoint, strict, fetch_z3_params=fetch_z3_params,
                                       z3_params_to_fetch=z3_params_to_fetch,
                                       allowed_missing_keys=allowed_missing_keys)  # fmt: skip

    def _make_dataloader(self, dataset, collate_fn):
        """`training_data` in order, split over the data-parallel ranks (DeepSpeed's pipeline engine gives
        `deepspeed_io` a sampler without shuffling): the first stage (inputs) and the last (labels) read the same
        samples. Not timed per batch: the throughput timer spans each `train_batch`."""
        return self._sharded_loader(dataset, collate_fn=collate_fn, shuffle=False)

    def _make_links(self) -> dict[int, Link]:
        """One link per part boundary this rank's chunks touch; boundary b lies between parts b - 1 and b, and
        part q lives on stage q % stages."""
        links, parts = {}, self.num_stages * self.chunks
        for chunk in range(self.chunks):
            part = chunk * self.num_stages + self.stage_id
            for boundary, peer_part in ((part, part - 1), (part + 1, part + 1)):
                if 0 < boundary < parts:
                    peer = self.grid.stage_to_global(peer_part % self.num_stages)
                    links[boundary] = Link(peer, self.device, tag=boundary)
        return links

    def _input_link(self, chunk: int) -> Link:
        return self.links[chunk * self.num_stages + self.stage_id]

    def _output_link(self, chunk: int) -> Link:
        return self.links[chunk * self.num_stages + self.stage_id + 1]

    def _is_last_part(self, chunk: int) -> bool:
        return self.is_last_stage() and chunk == self.chunks - 1

    # -- DeepSpeed's surface -----------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator) -> None:
        """Only the first stage (inputs) and the last (labels) read data, as in DeepSpeed."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn) -> None:
        """`fn(batch) -> batch` applied to every micro-batch read."""
        self.batch_fn = fn

    def get_additional_losses(self):
        """The module's additional losses (`PipelineModule.get_additional_losses()`, read after each
        micro-batch's loss on the last stage) of the last `train_batch`: each the mean over micro-batches and
        data-parallel replicas, on every stage, as an OrderedDict of name -> tensor; None when the module has
        none."""
        return self.agg_additional_losses

    def reset_activation_shape(self) -> None:
        """DeepSpeed's call for when activation shapes change between batches (curriculum sequence lengths).
        Nothing to reset here: each batch's first micro-batch describes its shapes again (pipe/p2p.py)."""

    # -- training and evaluation -------------------------------------------------------------------------------

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one global batch (gradient_accumulation_steps micro-batches) and the optimizer step.

        Returns the mean loss of the batch (over micro-batches and data-parallel replicas) on every stage.
        """
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self.optimizer is None:
            raise PipelineError("train_batch() needs an optimizer: pass one to initialize() or configure one")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        micro_batches = self.gradient_accumulation_steps()
        self.tput_timer.start()
        state = _BatchState(self._read_batches(micro_batches, "train_batch"))
        self.timers.start("train_batch")
        if self.chunks == 1:
            schedule = sched.TrainSchedule(micro_batches, self.num_stages, self.stage_id)
        else:
            schedule = sched.InterleavedTrainSchedule(
                micro_batches, self.num_stages, self.stage_id, self.chunks
            )
        self._execute(schedule, state)
        loss = self._aggregate_loss(state.losses, additional=state.additional)
        self.timers.stop("train_batch")
        self._window_loss = loss
        self._report_progress()
        self.tput_timer.stop(global_step=True, report_speed=self.global_rank == 0)
        self.observers.step_finished(self.global_steps)  # the autotuning probe may end the run here
        return loss

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):  # fmt: skip
        """Forward `num_micro_batches` (default gradient_accumulation_steps) micro-batches; no gradients.

        Returns the mean loss (`reduce_output="avg"`, on every stage with `bcast_loss`) or, with
        `reduce_output=None`, the last stage's list of per-micro-batch losses; with `return_logits`, also the
        last stage's final micro-batch output (None on other stages).
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        was_training = self.module.training
        self.module.eval()
        previous, self.data_iterator = self.data_iterator, None
        self.set_dataiterator(data_iter)
        micro_batches = num_micro_batches or self.gradient_accumulation_steps()
        try:
            state = _BatchState(self._read_batches(micro_batches, "eval_batch"))
            state.compute_loss = compute_loss
            schedule = sched.InferenceSchedule(micro_batches, self.num_stages, self.stage_id, self.chunks)
            self._execute(schedule, state)
        finally:
            self.data_iterator = previous
            self.module.train(was_training)
        if reduce_output == "avg":
            result = self._aggregate_loss(state.losses, broadcast=bcast_loss)
        else:
            result = state.losses if self.is_last_stage() else None
        if return_logits:
            return result, state.last_output if self.is_last_stage() else None
        return result

    # -- data --------------------------------------------------------------------------------------------------

    def _read_batches(self, count: int, caller: str) -> list:
        """Read this batch's micro-batches up front (first and last stage); every stage then learns together
        whether the data ran out, and raises the same error instead of waiting for activations forever."""
        batches, no_iterator, missing = [], 0, 0
        if self.is_first_stage() or self.is_last_stage():
            if self.data_iterator is None:
                no_iterator = 1
            else:
                for _ in range(count):
                    try:
                        batch = next(self.data_iterator)
                    except StopIteration:
                        break
                    batches.append(self.batch_fn(batch) if self.batch_fn else batch)
                missing = count - len(batches)
        # [no iterator anywhere, micro-batches missing anywhere]
        problems = torch.tensor([no_iterator, missing], device=self.device)
        if self.num_stages > 1:
            dist.all_reduce(problems, op=dist.ReduceOp.MAX, group=self.pipe_group)
        if problems[0].item():
            raise PipelineError(
                f"{caller}() has no data: pass data_iter, call set_dataiterator()/set_dataloader(), or give "
                "training_data to initialize()"
            )
        if problems[1].item():
            raise PipelineError(
                f"{caller}(): the data iterator ran dry after {count - int(problems[1].item())} of {count} "
                "micro-batches (wrap the loader in shardspeed.utils.RepeatingLoader to cycle it)"
            )
        return batches

    def _to_device(self, obj, cast: bool):
        if torch.is_tensor(obj):
            obj = obj.to(self.device)
            return obj.to(self.plan.param_dtype) if cast and obj.is_floating_point() else obj
        if isinstance(obj, tuple | list):
            return tuple(self._to_device(o, cast) for o in obj)
        return obj

    # -- the schedule executor ----------------------------------------------------------------------------------

    def _execute(self, schedule: sched.PipeSchedule, state: _BatchState) -> None:
        for link in self.links.values():
            link.reset()
        handlers = {
            sched.LoadMicroBatch: self._exec_load,
            sched.ForwardPass: self._exec_forward,
            sched.BackwardPass: self._exec_backward,
            sched.SendActivation: lambda st, key: self._output_link(key[1]).send_activations(st.outputs[key]),
            sched.RecvActivation: self._exec_recv_activation,
            sched.SendGrad: lambda st, key: self._input_link(key[1]).send_grads(st.inputs.pop(key)),
            sched.RecvGrad: self._exec_recv_grad,
        }
        for instruction in schedule.steps():
            if isinstance(instruction, sched.MicroBatchInstruction):
                handlers[type(instruction)](state, (instruction.micro_batch, instruction.chunk))
            elif isinstance(instruction, sched.ReduceTiedGrads):
                self.tied.reduce_grads(self._grad_view.__getitem__)
            elif isinstance(instruction, sched.ReduceGrads):
                self.optimizer.backward_begin(True)  # launch every bucket's data-parallel average now
                self.optimizer.backward_end()
            elif isinstance(instruction, sched.OptimizerStep):
                self._exec_optimizer_step(schedule.micro_batches)
        for link in self.links.values():
            link.flush()

    def _exec_load(self, state: _BatchState, key: tuple[int, int]) -> None:
        mb, chunk = key
        batch = state.batches[mb]
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise PipelineError(
                f"a pipeline micro-batch must be (inputs, labels); got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, tuple | list) else "")
            )
        if self.is_first_stage() and chunk == 0:
            inputs = self._to_device(batch[0], cast=self.plan.mixed)
            # a reentrant checkpoint function keeps gradients flowing only from inputs that require them
            reentrant = torch.is_grad_enabled() and self._reentrant_activation_checkpointing()
            state.inputs[key] = _requiring_grad(inputs) if reentrant else inputs
        if self._is_last_part(chunk):
            state.labels[key] = self._to_device(batch[1], cast=False)

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module checkpoints activations now with a reentrant function (DeepSpeed's name): any
        function but `checkpointing.non_reentrant_checkpoint` counts as one, so the first stage's inputs are
        then made to require grad. Read from the module, which `set_checkpoint_interval` may change later."""
        if self.module.activation_checkpoint_interval <= 0:
            return False
        return self.module.activation_checkpoint_func is not non_reentrant_checkpoint

    def _exec_recv_activation(self, state: _BatchState, key: tuple[int, int]) -> None:
        state.inputs[key] = self._input_link(key[1]).recv_activations()

    def _exec_recv_grad(self, state: _BatchState, key: tuple[int, int]) -> None:
        state.out_grads[key] = self._output_link(key[1]).recv_grads()

    def _exec_forward(self, state: _BatchState, key: tuple[int, int]) -> None:
        self.compression.before_forward(self.global_steps)
        outputs = self.module(state.inputs[key], chunk=key[1])
        if not self._is_last_part(key[1]):
            state.outputs[key] = outputs
            if not torch.is_grad_enabled():  # inference: nothing is kept for a backward pass
                state.inputs.pop(key, None)
            return
        state.last_output = outputs
        if state.compute_loss and self.module.loss_fn is not None:
            loss = self.module.loss_fn(outputs, state.labels.pop(key))
        else:
            loss = outputs
        state.losses.append(loss.detach())
        additional = self.module.get_additional_losses()
        if additional is not None:
            state.add_additional(additional)
        state.outputs[key] = loss
        if not torch.is_grad_enabled():  # inference keeps nothing for a backward pass
            state.outputs.pop(key)
            state.inputs.pop(key, None)

    def _exec_backward(self, state: _BatchState, key: tuple[int, int]) -> None:
        self.optimizer.backward_begin(False)  # accumulate locally; ReduceGrads averages once per batch
        outputs = state.outputs.pop(key)
        if self._is_last_part(key[1]):
            loss = outputs.float()
            gas = self.gradient_accumulation_steps()
            if gas > 1:
                loss = loss / gas
            self.optimizer.scaler.scale_loss(loss).backward()
        else:
            tensors = outputs if isinstance(outputs, tuple | list) else [outputs]
            carrying = [t for t in tensors if t.requires_grad and t.is_floating_point()]
            torch.autograd.backward(carrying, state.out_grads.pop(key))
        self.optimizer.backward_end()
        if self.is_first_stage() and key[1] == 0:
            state.inputs.pop(key, None)

    def _exec_optimizer_step(self, micro_batches: int) -> None:
        self._optimizer_step(None, "fp16 overflow: step skipped on every stage")
        self.micro_steps += micro_batches

    # -- checkpoints: the engine's save/load, with this stage's layer files (pipe/checkpoint.py) -------------

    def _make_checkpoint_parts(self) -> list:
        from shardspeed.checkpoint.rng import RngStates
        from shardspeed.checkpoint.tensor_parallel import TensorParallelState
        from shardspeed.pipe.checkpoint import PipelineLayers
        from shardspeed.runtime.engine_parts import model_part

        parts = super()._make_checkpoint_parts()
        # one model-states file per stage; RNG streams only restored at the same layout
        replaced = {
            "model": model_part(self, PipelineLayers, num_stages=self.num_stages, stage=self.stage_id),
            "tensor_parallel": TensorParallelState(None, files=self.num_stages),
            "rng": RngStates(after_relayout=False),
        }  # fmt: skip
        return [replaced.get(part.name, part) for part in parts]

    def _checkpoint_placement(self):
        from shardspeed.runtime.engine_parts import placement

        return placement(self, mp_rank=self.stage_id)  # the stage names this rank's files

    # -- reductions across stages -----------------------------------------------------------------------------

    def _pipeline_norm(self, stage_norm: float) -> float:
        """Global gradient norm from this stage's (data-parallel-reduced) norm: sum of squares over stages,
        tied copies counted once. inf/nan anywhere makes it inf/nan everywhere (one overflow decision)."""
        squares = torch.tensor(
            [stage_norm**2 - self._duplicate_square()], dtype=torch.float64, device=self.device
        )
        if self.num_stages > 1:
            dist.all_reduce(squares, group=self.pipe_group)
        total = squares.item()
        if math.isnan(total):
            return total
        return math.sqrt(max(total, 0.0))

    def _duplicate_square(self) -> float:
        """Squared norm of the averaged gradients of tied copies this stage holds but does not own."""
        reducer = self._grad_reducer
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.tied.duplicate_params():
            view = self._grad_view[p]
            if reducer.sharded:  # ZeRO-1: this rank holds the averaged values of its shard of the bucket only
                bucket = next(b for b in reducer.buckets if any(v is view for v in b.views))
                start = view.storage_offset() - bucket.buffer.storage_offset()
                lo = max(start, reducer.rank * bucket.shard_numel)
                hi = min(start + view.numel(), (reducer.rank + 1) * bucket.shard_numel)
                view = bucket.buffer[lo:hi] if hi > lo else bucket.buffer[:0]
            total += torch.linalg.vector_norm(view.float(), dtype=torch.float32).double() ** 2
        if reducer.sharded and self.tied.duplicate_params():
            dist.all_reduce(total, group=self.dp_group)
        return total.item()

    def _aggregate_loss(self, losses: list[torch.Tensor], broadcast: bool = True, additional=None):
        """Mean over micro-batches and data-parallel replicas, computed on the last stage, sent to all; the same
        for each of the module's `additional` losses (train_batch), which end in `self.agg_additional_losses`.
        The other stages name those values with their own module's `get_additional_losses()` keys, as
        DeepSpeed does (the module knows its losses' names on every stage)."""
        names: list[str] = []
        if self.is_last_stage():
            names = list(additional or {})
            means = [torch.stack([x.float().mean() for x in losses]).mean()]
            values = torch.stack(means + [torch.stack(additional[name]).mean() for name in names])
            if self.world_size > 1:
                dist.all_reduce(values, group=self.dp_group)
                values /= self.world_size
        else:
            values = torch.zeros(1, dtype=torch.float32, device=self.device)
        if broadcast and self.num_stages > 1:
            values = self._broadcast_from_last_stage(values)
            if not self.is_last_stage():
                names = self._additional_loss_names(values.numel() - 1)
        if additional is not None:  # eval_batch leaves the last training batch's, as DeepSpeed's does
            self.agg_additional_losses = OrderedDict(zip(names, values[1:])) if names else None
        return values[0].clone()

    def _broadcast_from_last_stage(self, values: torch.Tensor) -> torch.Tensor:
        """The last stage's [loss, additional...] on every stage: [loss, count] first, then the additional
        values in a second broadcast only when there are any (reading the count is one device sync)."""
        last = self.grid.stage_to_global(self.num_stages - 1)
        if self.is_last_stage():
            head = torch.stack([values[0], torch.tensor(float(values.numel() - 1), device=self.device)])
        else:
            head = torch.zeros(2, dtype=torch.float32, device=self.device)
        dist.broadcast(head, src=last, group=self.pipe_group)
        count = int(head[1].item())
        tail = values[1:].contiguous() if self.is_last_stage() else torch.zeros(count, device=self.device)
        if count:
            dist.broadcast(tail, src=last, group=self.pipe_group)
        return torch.cat([head[:1], tail])

    def _additional_loss_names(self, count: int) -> list[str]:
        if not count:
            return []
        local = self.module.get_additional_losses()
        names = list(local or {})
        if len(names) != count:
            raise PipelineError(
                f"the last stage's module reported {count} additional losses, but get_additional_losses() on "
                f"stage {self.stage_id} names {len(names)}; it must return the same names on every stage"
            )
        return names
