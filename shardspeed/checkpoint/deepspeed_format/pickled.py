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

Writing goes the other way (`PICKLE_MODULE`, for `torch.save(..., pickle_module=...)`): DeepSpeed's ZeRO-3 loader
needs a loss-scaler *object* in the file, so `loss_scaler(cur_scale)` and `zero_stage(n)` are pickled under
DeepSpeed's names. Nothing of DeepSpeed is imported to do so: the pickler writes the names itself.
"""

from __future__ import annotations

import pickle
import types

import torch

__all__ = [
    "ALLOWED_GLOBALS",
    "PICKLE_MODULE",
    "FragmentAddress",
    "SavedLossScaler",
    "load",
    "loss_scaler",
    "plain",
    "zero_stage",
]


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


# -- writing ------------------------------------------------------------------------------------------------


class _ZeroStageEnumName:
    """Only a name to write: `ZeroStageEnum` (the pickler writes classes through `save_global`)."""


class _ZeroStage(int):
    """A ZeRO stage that pickles as DeepSpeed's `ZeroStageEnum(n)` (an int everywhere else)."""

    def __reduce__(self):
        return (_ZeroStageEnumName, (int(self),))


def zero_stage(n: int) -> int:
    return _ZeroStage(n)


def loss_scaler(cur_scale: float = 1.0) -> SavedLossScaler:
    """A static loss scaler as DeepSpeed 0.19 pickles it (`LossScaler` with `cur_scale` and `dynamic`)."""
    scaler = SavedLossScaler()
    scaler.cur_scale, scaler.dynamic = float(cur_scale), False
    return scaler


_WRITE_AS = {SavedLossScaler: "deepspeed.runtime.fp16.loss_scaler.LossScaler", _ZeroStageEnumName:
             "deepspeed.runtime.zero.config.ZeroStageEnum"}  # fmt: skip


class _Pickler(pickle._Pickler):
    """Python's pickler, writing the stand-ins above under DeepSpeed's names (GLOBAL opcodes, no import)."""

    def save_global(self, obj, name=None):
        target = _WRITE_AS.get(obj)
        if target is None:
            return super().save_global(obj, name)
        module, qualname = target.rsplit(".", 1)
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


PICKLE_MODULE = types.SimpleNamespace(Pickler=_Pickler, __name__="shardspeed_deepspeed_pickle")
