"""Nested-dict helpers of the autotuner: DeepSpeed configs are JSON objects, and experiments are edits of one.

DeepSpeed keeps these in `deepspeed/autotuning/utils.py`; `deepspeed.autotuning.utils` resolves here
(shardspeed/compat/paths.py). `get_val_by_key` / `set_val_by_key` search every nested object for a key name
(how `arg_mappings` finds an experiment's value for a script argument); the others build the experiments.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

__all__ = [
    "all_combinations",
    "first_values",
    "get_val_by_key",
    "replace_dict",
    "set_val_by_key",
    "tuning_keys",
]


def get_val_by_key(d: dict, key: str) -> Any:
    """The value of `key` in `d` or in the first nested object (depth first, in order) that has it; None."""
    if key in d:
        return d[key]
    for value in d.values():
        if isinstance(value, dict):
            found = get_val_by_key(value, key)
            if found is not None:
                return found
    return None


def set_val_by_key(d: dict, key: str, value: Any) -> None:
    """Set `key` to `value` wherever it occurs in `d` and its nested objects (never adds it)."""
    if key in d:
        d[key] = value
    for child in d.values():
        if isinstance(child, dict):
            set_val_by_key(child, key, value)


def replace_dict(target: dict, updates: dict | None, ignored_keys: tuple[str, ...] = ()) -> dict:
    """Write `updates` into `target` recursively (objects merge, other values replace; a None value deletes
    the key); keys in `ignored_keys` are left alone. Returns `target`."""
    for key, value in (updates or {}).items():
        if key in ignored_keys:
            continue
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            child = target.get(key)
            target[key] = replace_dict(child if isinstance(child, dict) else {}, value, ignored_keys)
        else:
            target[key] = copy.deepcopy(value)
    return target


def first_values(config: Any, keep: tuple[str, ...] = ("optimizer", "scheduler")) -> Any:
    """`config` with every list of candidate values replaced by its first value (a runnable config).
    The blocks in `keep` are copied as they are: their lists are the optimizer's own (Adam's `betas`)."""
    if isinstance(config, dict):
        return {k: copy.deepcopy(v) if k in keep else first_values(v, keep) for k, v in config.items()}
    if isinstance(config, list):
        return copy.deepcopy(config[0]) if config else None
    return config


def all_combinations(space: dict) -> list[dict]:
    """Every config a tuning space describes: each list is a set of candidates, every other value fixed.

    {"stage": 2, "overlap_comm": [True, False], "reduce_bucket_size": [5e7, 5e8]} gives 4 configs, in
    order (the last list varies fastest), without duplicates."""
    keys = list(space)
    choices = [
        all_combinations(v) if isinstance(v, dict) else (v if isinstance(v, list) and v else [v])
        for v in space.values()
    ]
    seen, configs = set(), []
    for combination in itertools.product(*choices):
        config = dict(zip(keys, combination, strict=True))
        text = json.dumps(config, sort_keys=True, default=str)
        if text not in seen:
            seen.add(text)
            configs.append(config)
    return configs


def tuning_keys(space: dict) -> list[str]:
    """Names of the keys of `space` (at any depth) that hold more than one candidate."""
    keys = []
    for key, value in space.items():
        if isinstance(value, dict):
            keys += tuning_keys(value)
        elif isinstance(value, list) and len(value) > 1:
            keys.append(key)
    return keys
