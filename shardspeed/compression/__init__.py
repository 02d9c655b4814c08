"""Compression (DeepSpeed's ``deepspeed.compression``, as of 0.18.9): quantize, prune and shrink a model.

    from shardspeed.compression.compress import init_compression, redundancy_clean
    model = init_compression(model, ds_config)            # layers become compression layers
    engine, *_ = shardspeed.initialize(model=model, config=ds_config)   # the engine steps the schedule
    ... train ...
    model = redundancy_clean(model, ds_config)            # masks applied, pruned dims removed, weights packed
    export_packed(model, "model.safetensors")             # int8/int4/ternary/binary codes + group scales

Modules: ``compress`` (init_compression, redundancy_clean, student_initialization), ``scheduler``,
``basic_layer`` (the layers), ``helper``, ``config``, ``constants``, ``utils`` (DeepSpeed's autograd
quantizers) — DeepSpeed's names; and shardspeed's own: ``quantizers`` (the arithmetic), ``compressible``
(the layers' shared mixin), ``techniques``, ``cleaning``, ``packed`` (packed layers), ``export`` (packed
safetensors), ``distillation`` (XTC's loss), ``tensor_parallel`` (AutoTP), ``engine_part``.
See docs/compression.md.
"""

from .compress import init_compression, redundancy_clean, student_initialization
from .distillation import distillation_loss, hidden_state_loss
from .export import export_packed, load_packed_state
from .helper import convert_conv1d_to_linear
from .scheduler import compression_scheduler

__all__ = [
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "distillation_loss",
    "export_packed",
    "hidden_state_loss",
    "init_compression",
    "load_packed_state",
    "redundancy_clean",
    "student_initialization",
]
