"""Read DeepSpeed's checkpoint files safely: `torch.load(weights_only=True)` with four inert stand-ins.

DeepSpeed 0.19 pickles a few of its own objects into its optimizer files: the loss scaler
(`deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler`, rebuilt as an empty object whose
`__dict__` is then filled), the ZeRO stage (`deepspeed.runtime.zero.config.ZeroStageEnum`, an int enum rebuilt
by calling the class with the stage number) and the parameter fragments of ZeRO-1/2
(`deepspeed.utils.tensor_fragment.fragment_address`, an object with `numel` and `start`). A weights-only load
refuses them, and importing DeepSpeed to allow them would run its code.

Instead, torch's weights-only unpickler is told that those four names are the plain classes below (its
`safe_globals` accepts `(object, "module.Name")` pairs): an instance only ever gets its `__dict__` updated with
the pickled numbers, and the enum becomes an int. Everything else stays refused by torch's allow-list, so a
file naming any other global (another DeepSpeed version's class, or a pickle that would run code) is refused
naming that global, and nothing runs. After the load, the stand-ins are turned into plain dicts and ints
(`plain`), so the rest of the library never sees them.
"""

from __future__ import annotations

import torch

__all__ = ["ALLOWED_GLOBALS", "FragmentAddress", "SavedLossScaler", "load", "plain"]


class SavedLossScaler:
    """DeepSpeed's `LossScaler` / `DynamicLossScaler` as saved: only its attributes (cur_scale, dynamic, ...)."""


class FragmentAddress:
    """DeepSpeed's `fragment_address`: where a parameter's piece starts in a rank's partition, and its size."""


def _zero_stage(value):
    """`ZeroStageEnum(n)` as pickled: the stage number."""
    if not isinstance(value, int) or not 0 <= value <= 3:
        raise ValueError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return int(value)


ALLOWED_GLOBALS = [
    (SavedLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (SavedLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def plain(obj):
    """`obj` with every stand-in replaced by a dict of its attributes (containers rebuilt, tensors kept)."""
    if isinstance(obj, (SavedLossScaler, FragmentAddress)):
        return {k: plain(v) for k, v in vars(obj).items()}
    if isinstance(obj, dict):  # OrderedDict too: its order is what matters, a dict keeps it
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    return obj


def load(path, *, mmap: bool = False):
    """The content of a checkpoint file read weights-only, DeepSpeed's stand-ins allowed and made plain.

    Raises what torch.load raises (an UnpicklingError naming a refused global, an OSError, ...)."""
    with torch.serialization.safe_globals(ALLOWED_GLOBALS):
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    return plain(content)
