"""`PipelineModule`, `LayerSpec`, `TiedLayerSpec`: a model written as a list of layers, split into stages.

A `PipelineModule` is DeepSpeed's: the forward pass is `x = layer(x)` over `layers`; each rank builds only the
layers of its stage (specs are built lazily, so a model too large for one device never exists whole). The
built layers are registered under their *global* index, so parameter names (`"3.weight"`) do not depend on
the number of stages, and tied layers live under `tied_modules.<key>` on every stage that uses them.

Tied layers (`TiedLayerSpec`, e.g. an embedding reused as the output projection) share one module per stage;
at construction the copies are made equal (broadcast from the lowest stage holding the key), and the engine
sums their gradients over the stages holding the tie (`TiedWeights`), so the copies stay equal.

Activation checkpointing: with `activation_checkpoint_interval=k`, every run of k layers is recomputed in
backward instead of keeping its activations (by default `checkpointing.non_reentrant_checkpoint`:
`torch.utils.checkpoint`, non-reentrant, with the model-parallel RNG streams restored). Which runs qualify
(`_is_checkpointable`: one with parameters, or of `checkpointable_layers`) is cached per interval as DeepSpeed
does (`is_checkpointable_results`, rebuilt by `set_checkpoint_interval`).

Virtual stages (beyond DeepSpeed; Megatron's interleaved pipeline): with `virtual_stages=v` the layers are split
into `num_stages * v` parts and rank r holds v "chunks", parts r, r + p, r + 2p, ... (p = num_stages). A
micro-batch then visits every rank v times, and the interleaved 1F1B schedule (pipe/schedule.py) shrinks the
bubble by about v, at the price of v times more stage-to-stage transfers. `forward(x, chunk=c)` runs chunk c.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.checkpointing import non_reentrant_checkpoint
from shardspeed.comm.topology import ParallelGrid, PipeDataParallelTopology, ProcessTopology
from shardspeed.pipe.partition import PartitionError, partition_layers
from shardspeed.utils.logging import log_dist

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "TiedWeights"]


class LayerSpec:
    """A layer to build later, on the stage that owns it: `LayerSpec(nn.Linear, 4, 8, bias=False)`."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        if log:
            log_dist(f"building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` parameters are shared by every layer spec with the same `key`.

    `forward_fn(module, x)`, when given, replaces `module(x)` (e.g. an embedding used as the output head).
    """

    def __init__(
        self, key, typename, *module_args, forward_fn=None, tied_weight_attr="weight", **module_kwargs
    ):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


class PipelineModule(nn.Module):
    """Layers split into pipeline stages; this rank holds and runs only its stage's layers."""

    def __init__(
        self,
        layers,
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn=None,
        seed_layers: bool = False,
        seed_fn=None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func=None,
        checkpointable_layers=None,
        dynamic_shape: bool = False,
        virtual_stages: int = 1,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineModule needs torch.distributed: call shardspeed.init_distributed() first"
            )
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule needs num_stages or topology")
        world = dist.get_world_size()
        if topology is None:
            if world % num_stages != 0:
                raise ValueError(
                    f"PipelineModule: num_stages={num_stages} does not divide the world size {world} "
                    "(each stage needs the same number of data-parallel replicas)"
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        elif num_stages is not None and topology.get_dim("pipe") != num_stages:
            raise ValueError(f"num_stages={num_stages} but the topology has pipe={topology.get_dim('pipe')}")
        self._topo = topology
        self._grid = ParallelGrid(topology)
        self.num_stages = topology.get_dim("pipe")
        self.stage_id = self._grid.get_stage_id()
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func or non_reentrant_checkpoint
        # DeepSpeed's cache of `_is_checkpointable` per run of `activation_checkpoint_interval` layers: one list
        # per chunk of this rank, for the interval recorded beside it (None: not computed for these layers)
        self._checkpointable_runs: list[list[bool]] = []
        self.is_checkpointable_results_interval: int | None = None
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self._layer_specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        self.partition_method = partition_method
        self._partition(int(virtual_stages))

    # -- construction ---------------------------------------------------------------------------------------

    def _partition(self, virtual_stages: int) -> None:
        """Split the layers into `num_stages * virtual_stages` parts and build this rank's chunks."""
        self._check_virtual_stages(virtual_stages)
        self.virtual_stages = virtual_stages
        self.parts = partition_layers(
            self.partition_method,
            self.num_stages * virtual_stages,
            [_layer_name(s) for s in self._layer_specs],
            self._param_counts,
        )
        what = "stage" if virtual_stages == 1 else f"part (rank = part % {self.num_stages})"
        log_dist(f"pipeline partition ({self.partition_method}): {what} bounds {self.parts}")
        # chunk c of this rank is part c * num_stages + stage_id: layers [start, stop)
        self.chunk_ranges = [
            (
                self.parts[c * self.num_stages + self.stage_id],
                self.parts[c * self.num_stages + self.stage_id + 1],
            )
            for c in range(virtual_stages)
        ]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunk_funcs: list[list] = [self._build(start, stop) for start, stop in self.chunk_ranges]
        # DeepSpeed's attribute (every chunk's layers in order); the forward itself runs `chunk_funcs[chunk]`
        self.forward_funcs = [f for funcs in self.chunk_funcs for f in funcs]
        self.is_checkpointable_results_interval = None  # the layers changed: the cache no longer fits them
        self._precompute_checkpointable_values()
        self.tied = TiedWeights(self)
        self.tied.sync_weights()

    def _check_virtual_stages(self, virtual_stages: int) -> None:
        if virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be >= 1, got {virtual_stages}")
        parts = self.num_stages * virtual_stages
        if virtual_stages > 1 and parts > len(self._layer_specs):
            raise PartitionError(
                f"PipelineModule: {self.num_stages} stages x {virtual_stages} virtual stages = {parts} parts but "
                f"only {len(self._layer_specs)} layers; every part needs a layer"
            )

    def set_virtual_stages(self, virtual_stages: int) -> None:
        """Re-split into `virtual_stages` chunks per rank, rebuilding this rank's layers (collective)."""
        if virtual_stages == self.virtual_stages:
            return
        self._check_virtual_stages(virtual_stages)  # before anything is taken down
        for name in [n for n, _ in self.named_children() if n.isdigit() or n == "tied_modules"]:
            delattr(self, name)
        self._partition(int(virtual_stages))

    def _param_counts(self) -> list[int]:
        counts = []
        for spec in self._layer_specs:
            layer = spec.build() if isinstance(spec, LayerSpec) else spec
            counts.append(
                sum(p.numel() for p in layer.parameters() if p.requires_grad)
                if isinstance(layer, nn.Module)
                else 0
            )
        return counts

    def _build(self, start: int, stop: int) -> list:
        """Build layers [start, stop); returns what the forward calls for each."""
        funcs = []
        for index in range(start, stop):
            spec = self._layer_specs[index]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                module = self.tied_modules[spec.key]
                funcs.append(functools.partial(spec.forward_fn, module) if spec.forward_fn else module)
            elif isinstance(spec, LayerSpec):
                module = spec.build()
                self.add_module(str(index), module)
                funcs.append(module)
            elif isinstance(spec, nn.Module):
                self.add_module(str(index), spec)
                funcs.append(spec)
            elif callable(spec):
                funcs.append(spec)
            else:
                raise TypeError(f"PipelineModule layer {index} is not a module, spec or callable: {spec!r}")
        return funcs

    def tied_keys_by_stage(self) -> dict[str, list[int]]:
        """Every tied key of the whole model and the stages that hold it (the same answer on every rank)."""
        stages: dict[str, list[int]] = {}
        for part in range(len(self.parts) - 1):
            stage = part % self.num_stages
            for spec in self._layer_specs[self.parts[part] : self.parts[part + 1]]:
                if isinstance(spec, TiedLayerSpec) and stage not in stages.setdefault(spec.key, []):
                    stages[spec.key].append(stage)
        return {key: sorted(held) for key, held in sorted(stages.items())}

    # -- forward ----------------------------------------------------------------------------------------------

    def forward(self, inputs, chunk: int = 0):
        interval = self.activation_checkpoint_interval
        funcs = self.chunk_funcs[chunk]
        if interval == 0 or not torch.is_grad_enabled():
            return _run_layers(funcs, inputs)
        self._precompute_checkpointable_values()  # a no-op unless the interval changed since
        x = inputs
        for start, checkpointable in zip(range(0, len(funcs), interval), self._checkpointable_runs[chunk]):
            block = funcs[start : start + interval]
            if checkpointable:
                args = x if isinstance(x, tuple) else (x,)
                x = self.activation_checkpoint_func(_ChunkRunner(block), *args)
            else:
                x = _run_layers(block, x)
        return x

    def _precompute_checkpointable_values(self) -> None:
        """Decide once per interval which runs of `activation_checkpoint_interval` layers forward() checkpoints
        (DeepSpeed's name): the cache is rebuilt, never extended, when the interval differs from the one it
        was computed for, so forward() never pairs runs with flags of another interval."""
        interval = self.activation_checkpoint_interval
        if interval <= 0 or interval == self.is_checkpointable_results_interval:
            return
        self._checkpointable_runs = [
            [
                self._is_checkpointable(funcs[start : start + interval])
                for start in range(0, len(funcs), interval)
            ]
            for funcs in self.chunk_funcs
        ]
        self.is_checkpointable_results_interval = interval

    @property
    def is_checkpointable_results(self) -> list[bool]:
        """DeepSpeed's list: for each run of `activation_checkpoint_interval` layers of this rank (in order,
        over its chunks), whether forward() checkpoints it. Empty until computed for a positive interval."""
        return [flag for runs in self._checkpointable_runs for flag in runs]

    def _is_checkpointable(self, funcs) -> bool:
        modules = [f for f in funcs if isinstance(f, nn.Module)]
        if self.checkpointable_layers is not None:
            return any(type(m).__name__ in self.checkpointable_layers for m in modules)
        return any(any(True for _ in m.parameters()) for m in modules)

    # -- DeepSpeed's accessors -------------------------------------------------------------------------------

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> ParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def partitions(self) -> list[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"layer {layer_idx} is outside 0..{len(self._layer_specs) - 1}")
        part = next(i for i in range(len(self.parts) - 1) if self.parts[i] <= layer_idx < self.parts[i + 1])
        return part % self.num_stages

    def local_layers(self) -> list[tuple[int, nn.Module | None]]:
        """(global index, module) for this stage's layers; tied layers give their shared module."""
        out = []
        for index in (i for start, stop in self.chunk_ranges for i in range(start, stop)):
            spec = self._layer_specs[index]
            if isinstance(spec, TiedLayerSpec):
                out.append((index, self.tied_modules[spec.key]))
            elif isinstance(spec, LayerSpec | nn.Module):
                out.append((index, getattr(self, str(index))))
        return out

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every `interval` layers from the next forward on (0: off)."""
        if int(interval) < 0:
            raise ValueError(f"PipelineModule.set_checkpoint_interval: interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = int(interval)
        self._precompute_checkpointable_values()

    def get_additional_losses(self):
        """Losses to report beside the training loss (DeepSpeed's hook; None here). A subclass returns
        {name: scalar tensor}, the same names on every stage; the pipeline engine reads it after each
        micro-batch's loss on the last stage and averages the values into `engine.get_additional_losses()`."""
        return None


class _ChunkRunner:
    """Runs a few layers; what the activation checkpoint recomputes (unpacks single inputs as DeepSpeed)."""

    def __init__(self, funcs):
        self.funcs = funcs

    def __call__(self, *inputs):
        return _run_layers(self.funcs, inputs[0] if len(inputs) == 1 else inputs)


def _run_layers(funcs, x):
    for f in funcs:
        x = f(x)
    return x


def _layer_name(spec) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    return (
        type(spec).__name__ if isinstance(spec, nn.Module) else getattr(spec, "__name__", type(spec).__name__)
    )


def _resolve_attr(module: nn.Module, dotted: str) -> nn.Parameter:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


class TiedWeights:
    """The tied parameters of this stage and, per tie, the group of stages (same other coordinates) holding it.

    Groups are created on every rank for every tie and every replica, in a fixed order (new_group is
    collective). The stage with the lowest id owns the tie: its copy is the one broadcast at start, and the
    one counted in the global gradient norm.
    """

    def __init__(self, module: PipelineModule):
        grid, topo = module.mpu(), module.topology()
        self.entries: list[tuple[str, list[nn.Parameter], object, int, bool]] = []
        others = [a for a in topo.get_axis_names() if a != "pipe"]
        my_coord = topo.get_coord(grid.get_global_rank())
        for key, stages in module.tied_keys_by_stage().items():
            if len(stages) < 2:
                continue
            for rank in range(topo.world_size()):  # one group per replica slice, found by its stage-0 peer
                coord = topo.get_coord(rank)
                if coord["pipe"] != 0:
                    continue
                ranks = [topo.get_rank(**{a: coord[a] for a in others}, pipe=s) for s in stages]
                group = dist.new_group(ranks=ranks)
                mine = all(coord[a] == my_coord[a] for a in others) and module.stage_id in stages
                if mine:
                    tied_module = module.tied_modules[key]
                    params = [_resolve_attr(tied_module, attr) for attr in module.tied_weight_attrs[key]]
                    self.entries.append((key, params, group, ranks[0], module.stage_id == stages[0]))

    def sync_weights(self) -> None:
        """Make every stage's copy equal to the owner's."""
        for _, params, group, owner, _ in self.entries:
            for p in params:
                dist.broadcast(p.data, src=owner, group=group)

    def params(self) -> list[nn.Parameter]:
        return [p for _, params, _, _, _ in self.entries for p in params]

    def duplicate_params(self) -> list[nn.Parameter]:
        """Tied parameters held here but owned by an earlier stage: left out of the global norm."""
        return [p for _, params, _, _, owner in self.entries if not owner for p in params]

    def reduce_grads(self, grad_of) -> None:
        """Sum each tied parameter's gradient over the stages holding it (`grad_of(p)`: its accumulator)."""
        for _, params, group, _, _ in self.entries:
            for p in params:
                dist.all_reduce(grad_of(p), group=group)
