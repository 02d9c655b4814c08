"""DeepSpeed's `deepspeed.runtime.config_utils` helpers that need no pydantic.

DeepSpeed code and downstream configs import these next to `DeepSpeedConfigModel` (which is pydantic's, in
config_model.py, reached through the path table only when asked for): dict getters with a default, a
duplicate-key hook for `json.load`, an int that prints with thousands separators, and a JSON encoder that
writes large numbers in scientific notation. They keep DeepSpeed's signatures and results.
"""

from __future__ import annotations

import collections.abc
import json

__all__ = [
    "DeepSpeedConfigObject",
    "ScientificNotationEncoder",
    "dict_raise_error_on_duplicate_keys",
    "get_config_default",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
    "pp_int",
]


def get_scalar_param(param_dict: dict, param_name: str, param_default_value):
    """`param_dict[param_name]`, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


get_list_param = get_scalar_param
get_dict_param = get_scalar_param


def dict_raise_error_on_duplicate_keys(ordered_pairs: list) -> dict:
    """`object_pairs_hook` for `json.load`: the object as a dict, or ValueError naming every repeated key."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = [key for key, count in counts.items() if count > 1]
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)


def get_config_default(config, field_name: str):
    """The default of field `field_name` of a DeepSpeedConfigModel class (or instance); AssertionError, as in
    DeepSpeed, when there is no such field or it is required."""
    model = config if isinstance(config, type) else type(config)
    fields = model.model_fields
    if field_name not in fields:
        raise AssertionError(f"'{field_name}' is not a field in {model.__name__}")
    if fields[field_name].is_required():
        raise AssertionError(f"'{field_name}' is a required field and does not have a default value")
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):
    """An int whose repr is `custom_print_str` when given, else the value with thousands separators
    (`repr(pp_int(1e5)) == "100,000"`): how DeepSpeed's documented defaults print."""

    def __new__(cls, val, custom_print_str: str | None = None):
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """JSON with numbers above 1e3 in scientific notation (`5e8` rather than `500000000`), booleans as
    true/false, and objects one key per line: how DeepSpeed prints a config for a human."""

    def iterencode(self, o, _one_shot: bool = False, level: int = 0):
        indent = self.indent if self.indent is not None else 4
        inner = " " * (level + 1) * indent
        outer = " " * level * indent
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, int | float):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            items = [
                f'\n{inner}"{key}": {self.iterencode(value, level=level + 1)}' for key, value in o.items()
            ]
            return "{" + ", ".join(items) + f"\n{outer}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            # items of a list start again at level 0, as DeepSpeed writes them (same text as its encoder)
            return "[" + ", ".join(self.iterencode(item) for item in o) + "]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """A config object whose repr is its attributes as sorted JSON (ScientificNotationEncoder)."""

    def repr(self) -> dict:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)
