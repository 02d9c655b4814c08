"""Small helpers shared across the package (logging, process groups, z3 leaf marks, ...).

DeepSpeed's `deepspeed.utils` names that live elsewhere in shardspeed (`safe_get_full_grad`, `logger`,
`RepeatingLoader`, ...) come from the path table (shardspeed/compat/paths.py); nothing is imported here, so
the launcher, which imports `shardspeed.utils.logging`, does not pay for torch.
"""
