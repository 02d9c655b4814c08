"""DeepSpeed's `deepspeed.runtime.config_utils.DeepSpeedConfigModel`: the pydantic base of its config classes.

Downstream projects subclass it for their own configs, and DeepSpeed's tests define small models on it, so
it is a real pydantic model with DeepSpeed's behaviour (pydantic is imported only when this path is; it is in
shardspeed's `conformance` and `serve` extras). It is a public base class for other people's configs, not a
second config system: shardspeed's own blocks are dataclasses in `shardspeed.config`.

What a subclass gets, as in DeepSpeed:

* unknown keys are errors (`extra="forbid"`), assignments are validated, a field can be given by its name or
  its alias, enum fields hold their values;
* a deprecated field is declared `Field(default, json_schema_extra={"deprecated": True, "new_param":
  "new_name", "new_param_fn": convert})`: giving it logs a warning and, when `new_param` names the field
  that replaced it (`"sub.name"` reaches into a nested config), sets that field to `convert(value)` and
  removes the old one from the instance (unless `set_new_param` is false). Giving both the old and the new field is an AssertionError, as in DeepSpeed;
* `"auto"` values (HF Transformers' placeholders left unfilled) are dropped so the field keeps its default,
  as shardspeed's own config loader does, and with the same warning naming the keys (DeepSpeed drops them
  silently); `strict=True` keeps them, to be validated like any other value.
"""

from __future__ import annotations

import functools
import warnings

import torch
from pydantic import BaseModel, ConfigDict, field_serializer

from shardspeed.config.build import ConfigWarning
from shardspeed.utils.logging import logger

__all__ = ["DeepSpeedConfigModel"]

# DeepSpeed lets this one key keep "auto" (an inference config's injection policy)
_AUTO_IS_A_VALUE = "replace_method"


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


class DeepSpeedConfigModel(BaseModel):
    """Base class of DeepSpeed-style pydantic configs (see the module docstring for deprecated fields)."""

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data) -> None:
        if not strict:
            dropped = sorted(
                key for key, value in data.items() if _is_auto(value) and key != _AUTO_IS_A_VALUE
            )
            if dropped:
                warnings.warn(
                    f'{type(self).__name__}: "auto" left unfilled, so the default is used for: {", ".join(dropped)}',
                    ConfigWarning,
                    stacklevel=2,
                )
                data = {key: value for key, value in data.items() if key not in dropped}
        super().__init__(**data)
        self._apply_deprecated_fields()

    def _apply_deprecated_fields(self) -> None:
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._replace_deprecated(name, extra)

    def _replace_deprecated(self, name: str, extra: dict) -> None:
        new_name = extra.get("new_param", "")
        message = extra.get("deprecated_msg", "")
        logger.warning(
            f"Config parameter {name} is deprecated"
            + (f" use {new_name} instead" if new_name else "")
            + (f". {message}" if message else "")
        )
        if not new_name or not extra.get("set_new_param", True):
            return
        convert = extra.get("new_param_fn", lambda value: value)
        *parents, leaf = new_name.split(".")
        owner = functools.reduce(getattr, parents, self)  # the (nested) config holding the new field
        if leaf in owner.model_fields_set:
            raise AssertionError(
                f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_name}' together"
            )
        setattr(owner, leaf, convert(getattr(self, name)))  # validated: validate_assignment
        delattr(self, name)  # replaced: gone from the instance and its dump, as in DeepSpeed

    @field_serializer("dtype", check_fields=False)
    def _serialize_torch_dtype(self, dtype: torch.dtype) -> str:
        return str(dtype)
