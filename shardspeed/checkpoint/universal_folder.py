"""DeepSpeed's universal checkpoint layout (what `ds_to_universal` writes), read by parameter name.

Layout (DeepSpeed 0.19.8, `deepspeed/checkpoint/ds_to_universal.py`; tests/fixtures/ds_universal/ is one):

    <root>/latest_universal                      names the universal tag folder (loads with load_universal)
    <root>/<tag>/mp_rank_00_model_states.pt      the source checkpoint's model-states file, kept as it was:
                                                 counters, LR scheduler, config (the weights are not read)
    <root>/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same under ZeRO-3's name (a ZeRO-3 source)
    <root>/<tag>/zero/optimizer_state.pt         the optimizer's global state: `param_groups` (hyper-parameters),
                                                 `ds_version`, the loss scaler, ...
    <root>/<tag>/zero/<parameter name>/fp32.pt   {"param": the full fp32 value, "cat_dim": 0}
                                      /exp_avg.pt, /exp_avg_sq.pt, ... one per per-element optimizer state,
                                                 the same dict
                                      /step.pt   the optimizer step (a tensor), bare

A ZeRO-3 source converts to bare flat tensors instead of the dicts and to no `step.pt` (the step is then
`optimizer_state.pt`'s `optimizer_state_dict.state[0].step`); both forms are read. Parameters that never had
optimizer state (frozen ones) have only `fp32.pt`.

`UniversalFolderReader` presents such a folder with the interface of `CheckpointReader` (checkpoint/universal.py),
so resharding loads it into any world size and ZeRO stage exactly as it loads our own checkpoints. Opening
it checks the whole folder before anything is loaded — every parameter the model-states file lists has its
folder and `fp32.pt`, every parameter with optimizer state has the same state files as the others, every
tensor has its parameter's size — and raises `CheckpointError` naming the file and what was expected. Every
file is read with the weights-only loader; DeepSpeed's own classes in `optimizer_state.pt` (its loss scaler,
its ZeRO stage enum) are read as plain records, running none of DeepSpeed's code.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.named_values import NamedParameters, numel
from shardspeed.utils.logging import log_dist

__all__ = [
    "LATEST_UNIVERSAL",
    "OPTIMIZER_STATE_FILE",
    "ZERO_FOLDER",
    "UniversalFolderReader",
    "is_universal_folder",
    "model_states_file",
    "read_latest_universal",
    "read_record_file",
]

LATEST_UNIVERSAL = "latest_universal"
ZERO_FOLDER = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
FP32 = "fp32"
STEP = "step"
PARAM = "param"  # the key of the value in each state file's dict (DeepSpeed's `PARAM`)
STAGE3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def is_universal_folder(path) -> bool:
    return (Path(path) / ZERO_FOLDER / OPTIMIZER_STATE_FILE).is_file()


def read_latest_universal(root: Path) -> str:
    """The tag `<root>/latest_universal` names. Missing is an error, as in DeepSpeed: with `load_universal`
    there is no fresh start to fall back to."""
    latest = root / LATEST_UNIVERSAL
    if not latest.is_file():
        raise CheckpointError(
            f"load_universal: {latest} does not exist (ds_to_universal writes it beside the universal folder; "
            "or pass tag=)"
        )
    tag = latest.read_text().strip()
    if not tag or "/" in tag or "\\" in tag or tag.startswith("."):
        raise CheckpointError(f"{latest} names {tag!r}, which is not a checkpoint tag (a plain folder name)")
    return tag


def model_states_file(tag_dir: Path) -> Path:
    """The model-states file of a checkpoint folder: `mp_rank_00_model_states.pt`, or ZeRO-3's name."""
    for name in (files.model_states_name(0), STAGE3_MODEL_STATES):
        if (tag_dir / name).is_file():
            return tag_dir / name
    raise CheckpointError(
        f"{tag_dir} holds no model-states file ({files.model_states_name(0)} or {STAGE3_MODEL_STATES})"
    )


# -- DeepSpeed's classes, read as plain records -------------------------------------------------------------


class _Record:
    """What a DeepSpeed object in a checkpoint holds (its attributes), with none of its code."""

    def __setstate__(self, state) -> None:
        self.state = dict(state) if isinstance(state, dict) else {"value": state}


def _enum_value(value):
    return value


# DeepSpeed classes its optimizer files hold: the loss scalers (attributes only) and the ZeRO stage enum (its
# value). Allowing them by name lets the weights-only loader read the file; nothing of DeepSpeed is imported.
_RECORDS = [
    (_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def read_record_file(path: Path):
    """A checkpoint file read weights-only, DeepSpeed's loss scalers and stage enum as plain records."""
    problem = files.diagnose(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint file {path} {problem}")
    try:
        with torch.serialization.safe_globals(_RECORDS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint file {path} could not be read (corrupt, or holds objects a safe load refuses): {err}"
        ) from err


def _saved_shapes(model: dict) -> dict[str, torch.Size]:
    """Every parameter's shape the model-states file records: ours (a dict) or DeepSpeed's (a list of dicts
    per optimizer group, and `frozen_param_shapes`)."""
    recorded = model.get("param_shapes")
    groups = recorded if isinstance(recorded, list) else [recorded or {}]
    shapes = {name: torch.Size(shape) for group in groups for name, shape in group.items()}
    shapes.update({n: torch.Size(s) for n, s in (model.get("frozen_param_shapes") or {}).items()})
    return shapes


class UniversalFolderReader(NamedParameters):
    """A universal checkpoint folder presented by parameter name, with `CheckpointReader`'s interface.

    Values are whole: the folder holds every parameter in full, so any world size and stage slices what it
    needs. `check()` (run by the constructor) reads every file's header, memory-mapped, before any load.
    """

    _described_as = "universal checkpoint"

    mp_rank = 0

    def __init__(self, tag_dir, *, model_states: dict | None = None):
        self.path = Path(tag_dir)
        self.zero_dir = self.path / ZERO_FOLDER
        if not self.zero_dir.is_dir():
            raise CheckpointError(
                f"{self.path} is not a universal checkpoint: {self.zero_dir} (one folder per parameter) is missing"
            )
        self._model = (
            model_states if model_states is not None else files.read_checkpoint(model_states_file(self.path))
        )
        self._optimizer = read_record_file(self.zero_dir / OPTIMIZER_STATE_FILE)
        if not isinstance(self._optimizer, dict) or not isinstance(self._optimizer.get("param_groups"), list):
            raise CheckpointError(
                f"{self.zero_dir / OPTIMIZER_STATE_FILE} has no 'param_groups' list: not a universal checkpoint's "
                "optimizer state"
            )
        # The source run's stage and data-parallel size (for messages: the folder holds whole parameters).
        self.zero_stage = int(self._optimizer.get("zero_stage", self._model.get("zero_stage", 0)) or 0)
        self.world_size = int(self._model.get("dp_world_size", 1))
        self._module = self._model.get("module") or {}
        self._values: dict[str, dict[str, torch.Tensor]] = {}
        self.check()

    # -- checks ---------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Every file the load will read: present, readable, of its parameter's size (CheckpointError)."""
        recorded = _saved_shapes(self._model)
        folders = sorted(p.name for p in self.zero_dir.iterdir() if p.is_dir())
        # A frozen parameter may have been left out at save (exclude_frozen_parameters): the model check says so.
        frozen = set(self.frozen_param_names())
        recorded = {n: s for n, s in recorded.items() if n in folders or n not in frozen}
        missing = [n for n in recorded if n not in folders]
        if missing:
            raise CheckpointError(
                f"universal checkpoint {self.path} is missing parameter(s) {missing[:6]}: "
                f"{self.zero_dir / missing[0] / 'fp32.pt'} does not exist (the model-states file lists "
                f"{len(recorded)} parameters)"
            )
        order = [*recorded, *(n for n in folders if n not in recorded)]
        self._shapes: dict[str, torch.Size] = {}
        keys_of: dict[str, tuple[str, ...]] = {}
        for name in order:
            keys = self._check_parameter(name, recorded.get(name))
            if len(keys) > 1:
                keys_of[name] = keys
        kinds = sorted(set(keys_of.values()), key=len, reverse=True)
        if len(kinds) > 1:
            full = kinds[0]
            odd = next(n for n, k in keys_of.items() if k != full)
            absent = [k for k in full if k not in keys_of[odd]]
            raise CheckpointError(
                f"universal checkpoint {self.path}: {self.zero_dir / odd} lacks "
                f"{', '.join(f'{k}.pt' for k in absent) or 'no file'} (holds {[f'{k}.pt' for k in keys_of[odd]]}); "
                f"every parameter with optimizer state holds {[f'{k}.pt' for k in full]}"
            )
        self._state_keys = {name: [k for k in keys if k != FP32] for name, keys in keys_of.items()}
        stateless = [n for n in order if n not in keys_of and n not in frozen]
        if keys_of and stateless:
            log_dist(
                f"universal checkpoint {self.path}: parameter(s) {stateless[:6]} have no optimizer state "
                "(fp32.pt only): their optimizer state starts at zero",
                ranks=[0],
                level=30,
            )

    def _check_parameter(self, name: str, shape: torch.Size | None) -> tuple[str, ...]:
        """Read the headers of `name`'s files; returns their keys (fp32 first)."""
        folder = self.zero_dir / name
        if not (folder / f"{FP32}.pt").is_file():
            raise CheckpointError(f"universal checkpoint {self.path}: {folder / 'fp32.pt'} does not exist")
        keys = [FP32, *sorted(p.stem for p in folder.glob("*.pt") if p.stem != FP32)]
        values = {}
        for key in keys:
            value = read_record_file(folder / f"{key}.pt")
            if key == STEP:
                values[key] = value
                continue
            if isinstance(value, dict):
                value = value.get(PARAM)
            if not torch.is_tensor(value):
                raise CheckpointError(
                    f"{folder / f'{key}.pt'} holds no tensor (expected {{'param': tensor}} or a tensor)"
                )
            if shape is None:
                shape = value.shape
            if value.numel() != numel(shape) or (value.dim() > 1 and value.shape != shape):
                raise CheckpointError(
                    f"{folder / f'{key}.pt'} holds a tensor of shape {tuple(value.shape)}, expected "
                    f"{tuple(shape)} (parameter {name!r})"
                )
            values[key] = value
        self._shapes[name] = torch.Size(shape)
        self._values[name] = values
        return tuple(keys)

    # -- what the checkpoint holds (CheckpointReader's interface) ---------------------------------------------

    def frozen_param_names(self) -> list[str]:
        saved = self._model.get("frozen_param_names")
        return list(saved if saved is not None else (self._model.get("frozen_param_shapes") or {}))

    def shared_params(self) -> dict[str, str]:
        return dict(self._model.get("shared_params") or {})

    def buffer_names(self) -> list[str]:
        return [n for n in self._model.get("buffer_names", []) if n in self._module]

    def buffer(self, name: str) -> torch.Tensor:
        return self._module[name]

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: self._module[n].clone() for n in self.buffer_names()}

    def state_dict_keys(self) -> list[str]:
        return [*self._shapes, *self.shared_params(), *self.buffer_names()]

    def has_value(self, name: str) -> bool:
        return name in self._shapes or name in self.buffer_names()

    @property
    def has_optimizer_state(self) -> bool:
        return bool(self._optimizer["param_groups"])

    def param_group_of(self, name: str) -> int | None:
        """The group of `name` where the writer recorded it (shardspeed does); DeepSpeed records none."""
        for gi, names in enumerate(self._optimizer.get("shardspeed_param_names") or []):
            if name in names:
                return gi
        return None

    def param_groups(self) -> list[dict]:
        return [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in self._optimizer["param_groups"]
        ]

    def loss_scaler(self) -> dict | None:
        """The fp16 loss scaler's state when the source trained with fp16 loss scaling."""
        fp16 = (self._model.get("ds_config") or {}).get("fp16") or {}
        saved = self._optimizer.get("shardspeed_loss_scaler", self._optimizer.get("loss_scaler"))
        state = saved.state if isinstance(saved, _Record) else saved
        wanted = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        if fp16.get("enabled") is True and isinstance(state, dict) and all(k in state for k in wanted):
            return {k: state[k] for k in (*wanted, "dynamic") if k in state}
        return None

    # -- values ---------------------------------------------------------------------------------------------

    def _value(self, name: str, key: str) -> torch.Tensor:
        return self._values[name][key].reshape(-1)

    def fp32(self, name: str) -> torch.Tensor:
        self._check_name(name)
        return self._value(name, FP32).float().clone().view(self._shapes[name])

    def fp32_slice(self, name: str, lo: int, hi: int) -> torch.Tensor:
        self._check_name(name)
        return self._value(name, FP32)[lo:hi].float().clone()

    def frozen(self, name: str) -> torch.Tensor:
        """A frozen parameter's value in its training dtype: the model-states file's where it has it (fp32.pt
        holds it widened to fp32)."""
        self._check_name(name)
        saved = self._module.get(name)
        if torch.is_tensor(saved) and saved.shape == self._shapes[name]:
            return saved.clone()
        return self.fp32(name)

    def _step(self, name: str):
        if STEP in self._values[name]:
            return self._values[name][STEP]
        nested = (self._optimizer.get("optimizer_state_dict") or {}).get("state") or {}
        first = next(iter(nested.values()), {}) if isinstance(nested, dict) else {}
        return first.get(STEP) if isinstance(first, dict) else None

    def optimizer_state(self, name: str) -> dict:
        elements, scalars = self.optimizer_state_slice(name, 0, numel(self.shape(name)))
        return {**scalars, **{k: v.view(self._shapes[name]) for k, v in elements.items()}}

    def optimizer_state_slice(self, name: str, lo: int, hi: int) -> tuple[dict, dict]:
        self._check_name(name)
        keys = self._state_keys.get(name, [])
        elements = {k: self._value(name, k)[lo:hi].clone() for k in keys if k != STEP}
        scalars = {}
        if keys:
            step = self._step(name)
            if step is not None:
                scalars[STEP] = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))
        return elements, scalars
