"""DeepSpeed's checkpoint format: read what DeepSpeed 0.19 writes (ZeRO stages 0-3, fp32/bf16/fp16) by
parameter name, safely (no pickled code runs).

- pickled.py: weights-only loading with inert stand-ins for the few objects DeepSpeed pickles;
- layout.py: where ZeRO-1/2 and ZeRO-3 put each parameter's elements in the per-rank flat buffers;
- read.py: `DeepSpeedCheckpointReader`, with `CheckpointReader`'s interface;
- engine_view.py: a DeepSpeed model-states file under shardspeed's entry names, for the engine's parts.
"""

from shardspeed.checkpoint.deepspeed_format.engine_view import (
    DeepSpeedView,
    deepspeed_raw,
    engine_view,
    read_model_states,
)
from shardspeed.checkpoint.deepspeed_format.read import (
    SUPPORTED_VERSIONS,
    DeepSpeedCheckpointReader,
    is_deepspeed_state,
    model_states_path,
)

__all__ = [
    "SUPPORTED_VERSIONS",
    "DeepSpeedCheckpointReader",
    "DeepSpeedView",
    "deepspeed_raw",
    "engine_view",
    "is_deepspeed_state",
    "model_states_path",
    "read_model_states",
]
