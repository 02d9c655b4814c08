"""Small helpers shared across the package (logging, z3 leaf-module marks, OnDevice).

DeepSpeed's `deepspeed.utils` names that live elsewhere in shardspeed (`safe_get_full_grad`, `logger`,
`RepeatingLoader`, ...) come from the path table (shardspeed/compat/paths.py); nothing heavy is imported
here, so the launcher, which imports `shardspeed.utils.logging`, does not pay for torch.
"""

# `utils.z3_leaf_module` names both a submodule and, in DeepSpeed, the function in it: bind the function
# here, as DeepSpeed's package does, so that importing the submodule does not leave the module in its place.
from shardspeed.utils.z3_leaf_module import z3_leaf_module

__all__ = ["z3_leaf_module"]
