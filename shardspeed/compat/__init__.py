"""DeepSpeed's import paths on shardspeed: the one table (paths.py) and how it is applied (finder.py).

Also the few DeepSpeed-only objects those paths need: stand-ins for what is not offered (not_offered.py),
`isinstance` checks for DeepSpeed's optimizer-wrapper classes (optimizer_classes.py), DeepSpeed's enums
(deepspeed_types.py) and LR-schedule key names (lr_schedule_keys.py). Nothing here imports torch at
`import shardspeed` time.
"""

from shardspeed.compat.not_offered import NotOfferedError

__all__ = ["NotOfferedError"]
