"""Engine methods that Hugging Face Transformers, Accelerate and Lightning call on a DeepSpeed engine.

Mixed into `ShardspeedEngine`. Each one is a thin question to the config or a call into checkpoint/export.py;
the list of callers and what they expect is in docs/compatibility.md ("Hugging Face, Accelerate, Lightning").
"""

from __future__ import annotations

__all__ = ["IntegrationMethods"]


class IntegrationMethods:
    """`zero_gather_16bit_weights_on_model_save`, `_zero3_consolidated_16bit_state_dict` and friends."""

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether ZeRO-3 gathers full 16-bit weights for `save_16bit_model` (Accelerate asks before saving)."""
        return self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The full module state dict on rank 0, None on the others (collective: every rank must call it).

        DeepSpeed's name; the Trainer's `save_model` and Accelerate's `get_state_dict` call it under ZeRO-3.
        Works at every stage (below stage 3 the parameters are already full).
        """
        from shardspeed.checkpoint.export import consolidated_16bit_state_dict
        from shardspeed.runtime.engine_parts import weights_source

        return consolidated_16bit_state_dict(weights_source(self), exclude_frozen_parameters)
