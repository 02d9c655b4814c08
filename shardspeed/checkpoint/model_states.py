"""`ModelStates`: the checkpoint part of the module's weights and its optimizer wrapper's state.

Entries of the model-states file it owns: `module` (the state dict; at ZeRO-3 buffers only, parameters being
shards), `buffer_names`, `param_shapes` (every parameter's full shape), `frozen_param_names`,
`shared_params` (tied aliases), `optimizer` (stage 0's replicated wrapper state, else None), `zero_stage`,
`zero_partitions` (how many partition files were written) and `dp_world_size`. At ZeRO stages 1-3 every
rank also writes its own `zero_pp_rank_<D>_mp_rank_<T>_optim_states.pt`.

Loading picks one of three ways, by what the checkpoint's layout is against this engine's:
- same layout, stages 0-2: the module's state dict, then the wrapper's state (bit-exact resume);
- same layout, stage 3: buffers from the model-states file, parameters and state from this rank's shard;
- anything else (another data-parallel world size, ZeRO stage, bucket layout or tensor degree): every rank
  assembles its own shards by name through a `CheckpointReader` (checkpoint/universal.py) or, at another
  tensor degree, a `TensorParallelReader`; `ctx.resharded` tells the parts after it.

The wrapper is any optimizer wrapper of core/optimizer_wrapper.py's protocol: `zero_stage`, `state_dict()`,
`load_state_dict()`, `load_universal()`, `refresh_masters_from_module()`, and at ZeRO `buckets` and
`_frozen_units()` (their layouts decide whether a load reshards). MoE (moe/checkpoint.py) and the pipeline's
layer files (pipe/checkpoint.py) are subclasses that change where the weights go.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardspeed.checkpoint import files, verify
from shardspeed.checkpoint import tensor_parallel as tp_files
from shardspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointReader, deepspeed_raw
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.node_turns import node_turns
from shardspeed.checkpoint.parts import LoadContext, LoadOptions, Part, Placement, SaveOptions
from shardspeed.utils.logging import log_dist

__all__ = ["ModelStates", "shared_params"]


def shared_params(module) -> dict[str, str]:
    """Tied weights: state-dict keys that name the same tensor as an earlier parameter."""
    first: dict[int, str] = {}
    shared = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    return shared


def _shapes_differ(path: Path, mismatched: list[str]) -> CheckpointError:
    shown = "; ".join(mismatched[:6]) + (f"; and {len(mismatched) - 6} more" if len(mismatched) > 6 else "")
    return CheckpointError(
        f"checkpoint {path} was saved from a different model: {len(mismatched)} parameter shapes differ ({shown})"
    )


class ModelStates(Part):
    name = "model"
    keys = ("module", "buffer_names", "param_shapes", "frozen_param_names", "shared_params", "optimizer",
            "zero_stage", "zero_partitions", "dp_world_size")  # fmt: skip
    optional = True  # `check` names a file without these entries as not a shardspeed model-states file
    holds_weights = True
    reads_universal = True  # loads DeepSpeed's universal folders (`checkpoint.load_universal`)

    def __init__(self, module, optimizer, placement: Placement, *, zero_stage: int, tp, ds_config, version,
                 load_in_turns: bool = False):  # fmt: skip
        self.module = module
        self.optimizer = optimizer  # the stage's wrapper, or None
        self.placement = placement
        self.zero_stage = zero_stage  # the configured stage (also without an optimizer)
        self.tp = tp  # the tensor-parallel part (rank, size, partitions), or None
        self.ds_config = ds_config
        self.version = version
        # `pipeline_loading_checkpoint` (stage 3): a machine's ranks copy their partitions one after another
        self.load_in_turns = load_in_turns
        self._universal = None  # (path, reader) of the universal folder `check` opened, for `load_state_dict`

    # -- save -------------------------------------------------------------------------------------------------

    def _stage_wrappers(self) -> list:
        return [self.optimizer]

    def param_shapes(self) -> dict[str, tuple]:
        """Every parameter's full shape, in the module's order (released stage-3 parameters are empty
        tensors: their shapes come from the units' layouts)."""
        shapes = {n: tuple(p.shape) for n, p in self.module.named_parameters()}
        if self.zero_stage == 3 and self.optimizer is not None:
            units = [u for w in self._stage_wrappers() for u in (*w.buckets, *w._frozen_units())]
            shapes.update({n: tuple(s) for u in units for n, s in zip(u.names, u.shapes)})
        return shapes

    def replicated_optimizer(self) -> bool:
        return self.optimizer is not None and self.optimizer.zero_stage == 0

    def state_dict(self, options: SaveOptions) -> dict:
        module_state = self.module.state_dict()
        if self.zero_stage == 3:
            # Stage 3 parameters exist only as shards: they are in the per-rank partition files, not here
            # (tied aliases included: their entries would be released, empty tensors).
            params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
            module_state = {k: v for k, v in module_state.items() if k not in params}
        frozen = [n for n, p in self.module.named_parameters() if not p.requires_grad]
        if options.exclude_frozen:
            for name in frozen:
                module_state.pop(name, None)
        replicated = self.replicated_optimizer()
        return {
            "module": module_state,
            "buffer_names": [n for n, _ in self.module.named_buffers()],
            "param_shapes": self.param_shapes(),
            "frozen_param_names": frozen,
            "shared_params": shared_params(self.module),
            # Stage 0 keeps the (replicated) optimizer state here; ZeRO stages write one file per rank.
            "optimizer": self.optimizer.state_dict() if replicated else None,
            "zero_stage": self.zero_stage,
            # partition files written (none without an optimizer, or at stage 0): checked on load
            "zero_partitions": 0 if self.optimizer is None or replicated else self.placement.dp_world_size,
            "dp_world_size": self.placement.dp_world_size,
        }

    def partition_name(self) -> str:
        return files.zero_optim_states_name(self.placement.dp_rank, self.placement.mp_rank)

    def write_files(self, staging: Path, options: SaveOptions) -> None:
        if self.optimizer is not None and not self.replicated_optimizer():
            partition = {"optimizer_state_dict": self.optimizer.state_dict(), "ds_config": self.ds_config,
                         "ds_version": self.version}  # fmt: skip
            files.save_file(partition, staging / self.partition_name())

    # -- checks (every rank, before anything is loaded) ---------------------------------------------------------

    def check(self, path: Path, state: dict, options: LoadOptions) -> None:
        if options.universal:
            self._check_universal(path, state, options.strict)
            return
        if deepspeed_raw(state) is not None:
            if getattr(state, "moe", None) is not None:
                raise CheckpointError(
                    f"{path} is a DeepSpeed checkpoint of a model with MoE layers (num_experts "
                    f"{state.get('num_experts')}, layer_<L>_expert_<E>_* files): load it into a model with "
                    "the same MoE layers"
                )
            if getattr(state, "pipeline_stages", 1) > 1:
                raise CheckpointError(
                    f"{path} is a DeepSpeed pipeline checkpoint of {state.pipeline_stages} stages (layer files): "
                    "load it with a PipelineModule"
                )
            self._check_names_and_shapes(state, options.strict, path)
            self._check_deepspeed(path, state)
            return
        saved_stage = state.get("zero_stage")
        reshard = saved_stage in (0, 1, 2, 3) and self.needs_reshard(state, path)
        partitions_needed = saved_stage == 3 or options.optimizer or reshard
        if not isinstance(state.get("param_shapes"), dict) or not isinstance(state.get("module"), dict):
            raise CheckpointError(f"{path / files.model_states_name()} is not a shardspeed model-states file")
        self._check_names_and_shapes(state, options.strict, path)
        verify.check_consistent(self.placement, path, state, partitions_needed)

    def _check_deepspeed(self, path: Path, state: dict) -> None:
        """A DeepSpeed checkpoint: every partition file exists (the reader checks), and this rank reads and
        checks those `r` with `r % world == dp_rank` against the layout."""
        reader = self._deepspeed_reader(path, state)
        if reader.zero_stage > 0:
            for rank in range(self.placement.dp_rank, reader.world_size, self.placement.dp_world_size):
                reader.check_rank_file(rank)

    def _deepspeed_reader(self, path: Path, state: dict) -> DeepSpeedCheckpointReader:
        return DeepSpeedCheckpointReader(
            path, model_states=deepspeed_raw(state), mp_rank=self.placement.mp_rank
        )

    def _check_universal(self, path: Path, state: dict, strict: bool) -> None:
        """Open the universal folder (every file checked, checkpoint/universal_folder.py) and match it to the
        model, before anything is loaded."""
        from shardspeed.checkpoint.universal_folder import UniversalFolderReader

        if not self.reads_universal:
            raise CheckpointError(
                f"load_universal: universal checkpoints are not read into a model with {self.name} layers "
                "(MoE, pipeline); load shardspeed's own checkpoint, which reshards without conversion"
            )
        self._universal = None
        reader = UniversalFolderReader(path, model_states=state)
        if self.tp is not None and self.tp.size > 1:  # whole parameters, cut to this tensor rank's shards
            reader = tp_files.TensorParallelReader.cutting(reader, self.tp)
        self._check_same_model(reader, strict, path)
        self._universal = (path, reader)

    def _check_names_and_shapes(self, state: dict, strict: bool, path: Path) -> None:
        """The checkpoint's parameters against the model's, from the recorded shapes (nothing loaded yet)."""
        ours = self.param_shapes()
        saved = tp_files.translate_shapes(state, self.tp)  # at this rank's tensor degree
        mismatched = [
            f"{name!r}: checkpoint {saved[name]}, model {shape}"
            for name, shape in ours.items()
            if name in saved and saved[name] != shape
        ]
        if mismatched:
            raise _shapes_differ(path, mismatched)
        if not strict:
            return
        params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        aliases = set(state.get("shared_params", {}))
        buffers_ours = set(self.module.state_dict()) - params
        buffers_saved = set(state["module"]) - set(saved) - aliases
        missing = [n for n in ours if n not in saved] + sorted(buffers_ours - buffers_saved)
        unexpected = [n for n in saved if n not in ours] + sorted(buffers_saved - buffers_ours)
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {path} does not match the model: missing {missing[:6]}, unexpected {unexpected[:6]} "
                "(load_module_strict=False loads the rest)"
            )

    def needs_reshard(self, state: dict, path: Path) -> bool:
        """True when the checkpoint's partitioning differs from this engine's: another data-parallel world
        size, ZeRO stage, tensor degree, or (stages 1-3) bucket layout, e.g. after changing reduce_bucket_size."""
        if deepspeed_raw(state) is not None:  # DeepSpeed's layout: always assembled by name
            return True
        saved_stage, stage = state.get("zero_stage", 0), self.zero_stage
        if self.optimizer is None:  # nothing partitioned here: only stage-3 parameters need assembling
            return saved_stage == 3 or stage == 3
        if state.get("dp_world_size", 1) != self.placement.dp_world_size or saved_stage != stage:
            return True
        if tp_files.needs_tp_reshard(state, self.tp):
            return True
        if stage == 0:
            return False
        partition = path / self.partition_name()
        if not partition.is_file():
            return False  # the same-layout path reports the missing file
        try:
            saved = torch.load(partition, map_location="cpu", weights_only=True, mmap=True)[
                "optimizer_state_dict"
            ]
        except Exception:
            return False  # ditto for a corrupt one
        ours = [b.layout() for b in self.optimizer.buckets]
        frozen = [u.layout() for u in self.optimizer._frozen_units()]
        return saved.get("buckets") != ours or saved.get("frozen_buckets", []) != frozen

    # -- load -----------------------------------------------------------------------------------------------

    def load_state_dict(self, entries: dict, ctx: LoadContext) -> None:
        path, state, options = ctx.path, ctx.state, ctx.options
        if options.universal:
            opened, self._universal = self._universal, None
            if opened is None or opened[0] != path:
                raise CheckpointError(f"load_universal: {path} was not checked before loading")
            ctx.resharded = True
            self._load_resharded(state, path, options.strict, options.optimizer, reader=opened[1])
            return
        ctx.resharded = self.needs_reshard(state, path)
        if ctx.resharded:
            self._load_resharded(state, path, options.strict, options.optimizer)
        elif self.zero_stage == 3:
            self._load_stage3(state, path, options.optimizer)
        else:
            self._load_module(state, options.strict, path)
            if options.module_only:
                if self.optimizer is not None:
                    self.optimizer.refresh_masters_from_module()
                return
            self._load_optimizer(state, options.load_optimizer_states, path)

    def _load_resharded(self, state: dict, path: Path, strict: bool, load_optimizer_states: bool,
                        reader=None) -> None:  # fmt: skip
        """Load a checkpoint of any stage and world size: every rank assembles its own shards by name (from
        `reader` when given: a universal folder's)."""
        from shardspeed.checkpoint.universal import CheckpointReader

        if reader is None and deepspeed_raw(state) is not None:
            reader = self._deepspeed_reader(path, state)
        elif reader is None and tp_files.needs_tp_reshard(
            state, self.tp
        ):  # another tensor degree: merge and re-split by name
            reader = tp_files.TensorParallelReader(path, state, self.tp)
        elif reader is None:
            reader = CheckpointReader(path, model_states=state, mp_rank=state.get("mp_rank", 0))
        log_dist(
            f"resharding checkpoint {path}: saved at ZeRO stage {reader.zero_stage} by {reader.world_size} "
            f"data-parallel ranks, loading at stage {self.zero_stage} on {self.placement.dp_world_size}",
            ranks=[0],
        )
        self._check_same_model(reader, strict, path)
        restored: set[str] = set()
        with torch.no_grad():
            if self.optimizer is not None:
                restored = self.optimizer.load_universal(reader, load_optimizer_states)
            # Parameters outside the optimizer wrapper (frozen ones at stages 0-2, or no optimizer at all).
            for name, param in self.module.named_parameters():
                if name not in restored and reader.has_value(name):
                    param.data.copy_(reader.fp32(name))
        missing, unexpected = self.module.load_state_dict(reader.buffers(), strict=False)
        params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        missing = [k for k in missing if k not in params]
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"checkpoint {path} buffers do not match the model: missing {missing}, unexpected {unexpected}"
            )

    def _check_same_model(self, reader, strict: bool, path: Path) -> None:
        ours = self.param_shapes()
        saved = reader.param_shapes()
        mismatched = [
            f"{name!r}: checkpoint {tuple(saved[name])}, model {shape}"
            for name, shape in ours.items()
            if name in saved and tuple(saved[name]) != shape
        ]
        if mismatched:
            raise _shapes_differ(path, mismatched)
        missing = [n for n in ours if not reader.has_value(n)]
        unexpected = [n for n in saved if n not in ours]
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"checkpoint {path} does not match the model: missing parameters {missing[:6]}, unexpected "
                f"{unexpected[:6]} (load_module_strict=False loads the rest)"
            )

    def _load_module(self, state: dict, strict: bool, path: Path) -> None:
        if "module" not in state:
            raise CheckpointError(
                f"{path / files.model_states_name()} has no 'module' entry: not a model checkpoint"
            )
        ours = dict(self.module.named_parameters())
        mismatched = [
            f"{name!r}: checkpoint {tuple(tensor.shape)}, model {tuple(ours[name].shape)}"
            for name, tensor in state["module"].items()
            if name in ours and tuple(tensor.shape) != tuple(ours[name].shape)
        ]
        if mismatched:
            raise _shapes_differ(path, mismatched)
        try:
            self.module.load_state_dict(state["module"], strict=strict)
        except RuntimeError as err:
            raise CheckpointError(f"checkpoint {path} does not match the model: {err}") from err

    def _load_stage3(self, state: dict, path: Path, load_optimizer_states: bool) -> None:
        """Stage 3: buffers from the model file, parameters (and optimizer state) from this rank's shards."""
        if state.get("zero_stage") != 3:
            raise CheckpointError(
                f"checkpoint {path} was saved at ZeRO stage {state.get('zero_stage')}, not 3"
            )
        missing, unexpected = self.module.load_state_dict(state["module"], strict=False)
        params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        if unexpected or [k for k in missing if k not in params]:
            raise CheckpointError(f"checkpoint {path} buffers do not match the model: {missing + unexpected}")
        saved = self._optimizer_partition(path)
        turns = node_turns(self.load_in_turns, self.placement.device)
        try:
            self.optimizer.load_state_dict(saved, load_optimizer_states=load_optimizer_states, reading=turns)
        except (KeyError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"ZeRO-3 partition in {path} does not match this engine: {err}") from err

    def _optimizer_partition(self, path: Path) -> dict:
        """This rank's ZeRO optimizer partition, memory-mapped: the optimizer copies it sub-group by
        sub-group, so a partition larger than memory (NVMe offload) is read as it is copied."""
        return files.read_checkpoint(path / self.partition_name(), mmap=True)["optimizer_state_dict"]

    def _load_optimizer(self, state: dict, load_optimizer_states: bool, path: Path) -> None:
        optimizer = self.optimizer
        if optimizer is None:
            return
        if optimizer.zero_stage == 0 or not load_optimizer_states:
            saved = state.get("optimizer")
        else:
            saved = self._optimizer_partition(path)
        if not load_optimizer_states or saved is None:
            if hasattr(optimizer, "refresh_masters_from_module"):
                optimizer.refresh_masters_from_module()
            return
        if saved.get("zero_stage", 0) != optimizer.zero_stage:
            raise CheckpointError(
                f"checkpoint {path} holds ZeRO stage {saved.get('zero_stage')} optimizer state but this engine "
                f"runs stage {optimizer.zero_stage}"
            )
        try:
            optimizer.load_state_dict(saved)
        except (KeyError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"optimizer state in {path} does not match this optimizer: {err}") from err
