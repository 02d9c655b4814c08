"""DeepSpeed's `deepspeed.ops` optimizer classes with their constructor signatures, backed by torch's
optimizers or our pure-PyTorch ones: nothing here is compiled. Scripts that build
`deepspeed.ops.adam.FusedAdam(...)` and friends keep working after `import shardspeed as deepspeed`."""

from shardspeed.ops import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
