"""``compression_scheduler`` (``deepspeed.compression.scheduler``): switches techniques on at their steps.

The engine calls ``step(step_zero_check=True)`` before forwards while ``global_steps`` is 0 and ``step()``
after every applied optimizer step (skipped fp16 steps do not count), as DeepSpeed 0.18.9's engine does.
A technique switches on once ``training_steps >= schedule_offset`` (sparse pruning: at a step inside
``[schedule_offset, schedule_offset_end]``) and stays on. Each step with weight quantization on advances
every quantized layer's bit schedule (techniques.py).

``state_dict()`` holds the step count and every layer's switches and bit schedule, so a checkpoint resumes
the schedule exactly (the engine saves it with the other engine state); masks and scores are module state.
"""

from __future__ import annotations

from shardspeed.config.compression import TECHNIQUES, build_compression_config
from shardspeed.utils.logging import log_dist

from .compress import get_module_name
from .helper import recursive_getattr

__all__ = ["compression_scheduler"]

_FLAGS = {
    "weight_quantization": "weight_quantization_enabled",
    "activation_quantization": "activation_quantization_enabled",
    "sparse_pruning": "sparse_pruning_enabled",
    "row_pruning": "row_pruning_enabled",
    "head_pruning": "head_pruning_enabled",
    "channel_pruning": "channel_pruning_enabled",
}


class compression_scheduler:
    """Steps the techniques of ``compression_config`` (a DeepSpeed config or its typed block) on ``model``."""

    def __init__(self, model, compression_config):
        self.model = model
        self.compression_config = build_compression_config(compression_config)
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.verbose = dict.fromkeys(_FLAGS, False)  # whether each technique's switch-on was logged
        self._zero_step_quantized = False
        self.make_init()

    def make_init(self) -> None:
        """Find each enabled technique's modules: ``different_compression_methods[technique]``."""
        self.different_compression_methods = {}
        for technique in TECHNIQUES:
            block = self.compression_config.technique(technique)
            entry = {"enabled": block.shared_parameters.enabled, "shared_parameters": block.shared_parameters,
                     "different_groups": []}  # fmt: skip
            if entry["enabled"]:
                claimed: set[str] = set()
                for group_name, group in block.different_groups.items():
                    names = []
                    for pattern in group.modules:
                        found, claimed = get_module_name(
                            group_name, self.model, pattern, claimed, verbose=False
                        )
                        names += found
                    if names:
                        entry["different_groups"].append([group_name, names, group.params])
            self.different_compression_methods[technique] = entry

    # ---- DeepSpeed's per-technique checks --------------------------------------------------------------------
    def _due(self, technique: str) -> bool:
        shared = self.different_compression_methods[technique]["shared_parameters"]
        if technique == "sparse_pruning":
            return shared.schedule_offset <= self.training_steps <= shared.schedule_offset_end
        return self.training_steps >= shared.schedule_offset

    def _check(self, technique: str) -> None:
        entry = self.different_compression_methods[technique]
        if not entry["enabled"] or not self._due(technique):
            return
        for _, names, _ in entry["different_groups"]:
            for name in names:
                setattr(recursive_getattr(self.model, name), _FLAGS[technique], True)
        if technique == "weight_quantization":
            self.weight_quantization_enabled = True
        if not self.verbose[technique]:
            log_dist(f"{technique.replace('_', ' ')} is enabled at step {self.training_steps}")
            self.verbose[technique] = True

    def check_weight_quantization(self):
        self._check("weight_quantization")

    def check_activation_quantization(self):
        self._check("activation_quantization")

    def check_sparse_pruning(self):
        self._check("sparse_pruning")

    def check_head_pruning(self):
        self._check("head_pruning")

    def check_row_pruning(self):
        self._check("row_pruning")

    def check_channel_pruning(self):
        self._check("channel_pruning")

    def check_all_modules(self) -> None:
        for technique in _FLAGS:
            self._check(technique)

    # ---- stepping ------------------------------------------------------------------------------------------
    def _quantized_layers(self):
        for _, names, _ in self.different_compression_methods["weight_quantization"]["different_groups"]:
            for name in names:
                layer = recursive_getattr(self.model, name)
                if (
                    getattr(layer, "weight_quantization", None) is not None
                    and layer.weight_quantization_enabled
                ):
                    yield name, layer

    def _advance_bits(self) -> None:
        for name, layer in self._quantized_layers():
            layer.weight_quantization.advance(name)

    def step(self, step_zero_check: bool = False) -> None:
        """After an optimizer step: count it, advance bit schedules, switch techniques on when due.
        ``step_zero_check``: before the first step, switch on what is due at step 0 without counting."""
        if step_zero_check:
            self.check_all_modules()
            if self.weight_quantization_enabled and not self._zero_step_quantized:
                self._advance_bits()  # DeepSpeed quantizes at the first forward when schedule_offset is 0
                self._zero_step_quantized = True
            return
        if self.weight_quantization_enabled:
            self._advance_bits()
        self.training_steps += 1
        self.check_all_modules()

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def _layers(self):
        seen = set()
        for entry in self.different_compression_methods.values():
            for _, names, _ in entry["different_groups"]:
                for name in names:
                    if name not in seen:
                        seen.add(name)
                        yield name, recursive_getattr(self.model, name)

    def state_dict(self) -> dict:
        layers = {}
        for name, layer in self._layers():
            state = {flag: bool(getattr(layer, flag, False)) for flag in _FLAGS.values()}
            if getattr(layer, "weight_quantization", None) is not None:
                state["weight_quantization"] = layer.weight_quantization.state()
            layers[name] = state
        return {
            "training_steps": self.training_steps,
            "weight_quantization_enabled": self.weight_quantization_enabled,
            "verbose": dict(self.verbose),
            "zero_step_quantized": self._zero_step_quantized,
            "layers": layers,
        }

    def load_state_dict(self, state: dict) -> None:
        ours = dict(self._layers())
        missing = sorted(set(ours) - set(state["layers"]))
        unexpected = sorted(set(state["layers"]) - set(ours))
        if missing or unexpected:
            raise ValueError(
                f"compression scheduler state does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]} (was the checkpoint saved with another compression_training?)"
            )
        self.training_steps = int(state["training_steps"])
        self.weight_quantization_enabled = bool(state["weight_quantization_enabled"])
        self.verbose.update(state["verbose"])
        self._zero_step_quantized = bool(state["zero_step_quantized"])
        for name, layer_state in state["layers"].items():
            layer = ours[name]
            for flag in _FLAGS.values():
                if flag in layer_state:
                    setattr(layer, flag, layer_state[flag])
            if (
                "weight_quantization" in layer_state
                and getattr(layer, "weight_quantization", None) is not None
            ):
                layer.weight_quantization.load_state(layer_state["weight_quantization"])
