"""DeepSpeed's `deepspeed.ops` optimizer classes with their constructor signatures, backed by torch's
optimizers or our pure-PyTorch ones, and DeepSpeed4Science's Evoformer attention (`deepspeed4science`):
nothing here is compiled. Scripts that build `deepspeed.ops.adam.FusedAdam(...)` and friends keep working
after `import shardspeed as deepspeed`."""

from shardspeed.ops import adagrad, adam, deepspeed4science, lamb, lion

__all__ = ["adagrad", "adam", "deepspeed4science", "lamb", "lion"]
