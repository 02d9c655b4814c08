"""`initialize` and `add_config_arguments`: the two calls a DeepSpeed training script starts with."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from shardspeed.comm.discovery import discover
from shardspeed.comm.init import init_distributed
from shardspeed.config import ConfigError, load_config
from shardspeed.config.loader import read_config_source
from shardspeed.core.layout import build_parallel_grid, data_parallel_world
from shardspeed.core.usage_errors import ArgumentUsageError
from shardspeed.pipe.module import PipelineModule
from shardspeed.runtime.builders import check_config_blocks
from shardspeed.runtime.engine import ShardspeedEngine
from shardspeed.runtime.hybrid_engine import HybridEngine
from shardspeed.runtime.pipeline_engine import PipelineEngine
from shardspeed.runtime.tensor_parallel import merge_tp_model_init, prepare_tensor_parallel

# DeepSpeed's type names for the `optimizer=` / `lr_scheduler=` callables `initialize` accepts
DeepSpeedOptimizerCallable = Callable[[Iterable[nn.Parameter] | dict[str, Iterable]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def _config_source(args, config, config_params):
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None and getattr(args, "deepscale_config", None) is not None:
        from_args = args.deepscale_config
    if from_args is not None and config is not None:
        raise ConfigError(
            "the config was given twice: args.deepspeed_config and initialize(config=...); pass only one"
        )
    source = config if config is not None else from_args
    if source is None:
        raise ConfigError(
            "no config: pass initialize(config=<dict or path>) or --deepspeed_config <path> "
            "(add_config_arguments(parser) adds the flag)"
        )
    return source


def _announced_world_size(model, mpu, distributed_port: int) -> int:
    """The data-parallel world size this process will join, before any process group is initialised."""
    import torch.distributed as dist

    if isinstance(model, PipelineModule):  # built after init_distributed, with its topology
        return model.topology().get_dim("data")
    if dist.is_initialized():
        return mpu.get_data_parallel_world_size() if mpu is not None else dist.get_world_size()
    return discover(distributed_port=distributed_port).world_size


def _data_world_size(raw: dict, world: int, mpu) -> int:
    """The data-parallel degree: the world size over `sequence_parallel_size` (checked to divide it)."""
    sp = raw.get("sequence_parallel_size", 1)
    if mpu is not None or not isinstance(sp, int) or sp <= 1:
        return world  # an mpu answers for itself; a bad value is reported by load_config
    if world % sp != 0:
        raise ConfigError(f"sequence_parallel_size: {sp} does not divide the world size ({world})")
    return world // sp


def _check_data_parallel_size(cfg) -> None:
    """`data_parallel_size` (DeepSpeed's mesh key) must be the data-parallel size this job has."""
    if cfg.data_parallel_size not in (None, cfg.world_size):
        raise ConfigError(
            f"data_parallel_size: {cfg.data_parallel_size} but this job has {cfg.world_size} data-parallel "
            f"ranks (world size / sequence_parallel_size {cfg.sequence_parallel_size}"
            f"{' / tensor_parallel.autotp_size' if cfg.tensor_parallel.size > 1 else ''})"
        )


def _with_mesh(raw: dict, mesh_param) -> dict:
    """DeepSpeed's `mesh_param=(data, sequence)`: the config with that `sequence_parallel_size`."""
    if mesh_param is None:
        return raw
    if len(mesh_param) != 2:
        raise ValueError(f"mesh_param must be (data_parallel_size, sequence_parallel_size), got {mesh_param}")
    if raw.get("sequence_parallel_size", mesh_param[1]) != mesh_param[1]:
        raise ConfigError(f"sequence_parallel_size: {raw['sequence_parallel_size']} but mesh_param asks for "
                          f"{mesh_param[1]}; give one of them")  # fmt: skip
    return {**raw, "sequence_parallel_size": int(mesh_param[1])}


def initialize(
    args=None,
    model: nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = 29500,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """Build the training engine. Returns `(engine, optimizer, training_dataloader, lr_scheduler)`.

    `config` is a dict, a JSON/HJSON path or urlsafe-base64 JSON; `optimizer`/`lr_scheduler` may be
    instances or callables and override the config's blocks, as in DeepSpeed.
    """
    if model is None:
        hint = (
            ": the first positional argument is `args` (a namespace), not the model; pass model=..."
            if isinstance(args, nn.Module)
            else ""
        )
        raise ArgumentUsageError(f"initialize() needs a model{hint}")
    # The config is read (file, base64 or dict) once here; from then on the dict and the typed plan built
    # from it (`ShardspeedConfig`) are all that is used.
    raw = _with_mesh(read_config_source(_config_source(args, config, config_params)), mesh_param)
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple, dict, Tensor)):
        # `model.parameters()` is a generator: the config check below and the optimizer both read it
        model_parameters = list(model_parameters)
    # A bad config is refused before a process group (or anything else) exists: validated at the world
    # size the launcher announces, its optimizer and scheduler blocks tried on a throwaway parameter.
    raw, tp_size = merge_tp_model_init(raw, model)  # batch sizes count data-parallel replicas only
    announced = _announced_world_size(model, mpu, distributed_port)
    world = announced if mpu is not None else data_parallel_world(announced, tp_size)
    cfg = load_config(raw, world_size=_data_world_size(raw, world, mpu))
    _check_data_parallel_size(cfg)
    check_config_blocks(cfg, optimizer, lr_scheduler, model_parameters)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    import torch.distributed as dist

    engine_class = HybridEngine if cfg.hybrid_engine.enabled else ShardspeedEngine
    if isinstance(model, PipelineModule):  # as DeepSpeed: the pipeline engine, over the module's topology
        if cfg.hybrid_engine.enabled:  # DeepSpeed builds a plain PipelineEngine and never generates
            raise ConfigError("hybrid_engine.enabled: true cannot be combined with a PipelineModule (the "
                              "hybrid engine generates with the whole model; a pipeline holds one stage)")  # fmt: skip
        engine_class = PipelineEngine
        if mpu is not None:
            raise ValueError(
                "initialize(mpu=...) cannot be combined with a PipelineModule (it has a topology)"
            )
        mpu = model.mpu()
    # the user's mpu (or the pipeline's grid), or a grid for tensor or sequence parallelism from the config
    mpu = build_parallel_grid(cfg, mpu)
    tensor_parallel = None
    if tp_size > 1:
        tensor_parallel, model_parameters = prepare_tensor_parallel(
            cfg, model, mpu, model_parameters, optimizer
        )
    if mesh_param is not None and mesh_param[0] * mesh_param[1] != dist.get_world_size():
        raise ValueError(f"mesh_param {tuple(mesh_param)} (data, sequence) does not multiply to the world size "
                         f"({dist.get_world_size()})")  # fmt: skip
    world = mpu.get_data_parallel_world_size() if mpu is not None else dist.get_world_size()
    if world != cfg.world_size:
        cfg = load_config(cfg, world_size=world)  # the batch triple re-resolved from the same dict
        _check_data_parallel_size(cfg)
    if engine_class is PipelineEngine:
        mpu = None  # the pipeline engine takes the grid from the module
    engine = engine_class(
        model,
        cfg,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        collate_fn=collate_fn,
    )
    if tensor_parallel is not None:
        engine.tensor_parallel = tensor_parallel
        tensor_parallel.attach(engine.optimizer, engine.device)
    if "activation_checkpointing" in cfg.raw:  # DeepSpeed leaves this to the user; see compatibility.md
        from shardspeed import checkpointing

        checkpointing.configure(mpu, deepspeed_config=cfg)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` and `--deepspeed_config` flags (and the deprecated `--deepscale*`)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable DeepSpeed (informational)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
