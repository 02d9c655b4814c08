"""`shardspeed.pipe` (DeepSpeed's `deepspeed.pipe`): pipeline parallelism.

    from shardspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
    model = PipelineModule(layers=[LayerSpec(Block, ...), ...], num_stages=2, loss_fn=loss_fn)
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    loss = engine.train_batch(data_iter)

Layers and stages: module.py and partition.py; schedules: schedule.py; stage-to-stage transfers: p2p.py;
per-layer checkpoint files: checkpoint.py. The engine that runs them is shardspeed/runtime/pipeline_engine.py.
"""

from shardspeed.comm.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from shardspeed.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from shardspeed.pipe.partition import PartitionError

__all__ = [
    "LayerSpec",
    "PartitionError",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
]
