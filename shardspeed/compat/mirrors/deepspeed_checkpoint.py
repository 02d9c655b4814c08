"""DeepSpeed's `deepspeed.checkpoint.DeepSpeedCheckpoint` (what Megatron-DeepSpeed's conversion tools open), on
shardspeed's checkpoint files.

What keeps its meaning, and is offered: the source's parallel degrees (`tp_degree`, `pp_degree`, `dp_degree`,
`original_world_size`, `world_size`), the files (`file_list`, `mp_rank_files`, `layer_files`), the client state
Megatron stores in the model-states file (`get_iteration`, `get_args`, `get_checkpoint_info`), the pipeline
layer files by role (`get_embedding_state`, `get_transformer_state`, `get_final_norm_state` and their `*_files`
and maps; the transformer layers are spread over `pp_degree` stages as DeepSpeed spreads them), the model-states
file of a (tp, pp) rank (`get_2d_parallel_state`) and the partition files of a rank (`get_zero_files`).

What is refused by name (`NotOfferedError`): `get_zero_checkpoint_state` (it returns DeepSpeed's partition
layout — `base_optimizer_state`, `single_partition_of_fp32_groups`, `param_slice_mappings` — which shardspeed's
partition files do not have; `shardspeed.checkpoint.CheckpointReader` gives every value by parameter name, and
`ds_to_universal` writes the by-name layout), and another tensor degree than the checkpoint's (DeepSpeed merges
or splits Megatron's model-states files by Megatron's own rules; shardspeed's reader re-splits by name).

Every file is read with the weights-only loader.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardspeed.checkpoint import files
from shardspeed.checkpoint.universal import resolve_tag_dir
from shardspeed.compat.not_offered import NotOfferedError

__all__ = ["DeepSpeedCheckpoint"]

EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
_LAYER_FILE = re.compile(r"layer_(\d+)-model_.*")
_ZERO_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


class DeepSpeedCheckpoint:
    """One checkpoint tag folder, as DeepSpeed's reshaping helper presents it (see the module's notes)."""

    def __init__(self, dir, tp_degree=None, pp_degree=None, dp_degree=None,
                 final_layer_norm_idx=FINAL_LAYER_NORM_INDEX):  # fmt: skip
        self.dir = str(dir)
        self.final_layer_norm_idx = final_layer_norm_idx
        path = resolve_tag_dir(dir)
        self.file_list = sorted(str(p) for p in path.iterdir() if p.is_file())
        self.layer_files = sorted(f for f in self.file_list if _LAYER_FILE.fullmatch(Path(f).name))
        self.mp_rank_files = sorted(f for f in self.file_list if Path(f).name.startswith("mp_rank_"))
        if not self.mp_rank_files:
            raise AssertionError(
                f"{dir} seems a bogus DeepSpeed checkpoint folder: Cannot find mp_rank_* files in there."
            )
        self.global_state: dict = {}
        first = self._model_states(0)
        stages = (first.get("pipeline") or {}).get("num_stages", 1)
        self.src_pp_degree = int(stages)
        self.src_tp_degree = max(1, len(self.mp_rank_files) // self.src_pp_degree)
        self.src_dp_degree = int(first.get("dp_world_size", 1))
        self.tp_degree = self.src_tp_degree if tp_degree is None else tp_degree
        self.pp_degree = self.src_pp_degree if pp_degree is None else pp_degree
        self.dp_degree = self.src_dp_degree if dp_degree is None else dp_degree
        if self.tp_degree != self.src_tp_degree:
            raise NotOfferedError(
                f"DeepSpeedCheckpoint(tp_degree={tp_degree}) on a checkpoint of tensor degree {self.src_tp_degree}: "
                "Megatron's model-states files are not merged or split here; shardspeed loads a checkpoint at another "
                "tensor degree by name (engine.load_checkpoint, shardspeed.checkpoint.CheckpointReader)"
            )
        self.original_world_size = self.src_tp_degree * self.src_pp_degree * self.src_dp_degree
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        ids = sorted({int(_LAYER_FILE.fullmatch(Path(f).name).group(1)) for f in self.layer_files})
        self.layer_keys = [f"layer_{i:02d}" for i in ids]
        self.layer_count = len(self.layer_keys)

    # -- degrees ----------------------------------------------------------------------------------------------

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.src_tp_degree

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.src_pp_degree

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.src_dp_degree

    # -- client state Megatron keeps in the model-states file -----------------------------------------------

    def _model_states(self, index: int) -> dict:
        return files.read_checkpoint(Path(self.mp_rank_files[index]))

    def _get_checkpoint_value(self, key):
        if key not in self.global_state:
            self.global_state[key] = self._model_states(0).get(key)
        return self.global_state[key]

    def get_iteration(self):
        value = self._get_checkpoint_value("iteration")
        return 0 if value is None else value

    def get_args(self):
        return self._get_checkpoint_value("args")

    def get_checkpoint_info(self, info_key="checkpoint_info"):
        return self._get_checkpoint_value(info_key)

    # -- pipeline layer files by role ------------------------------------------------------------------------

    def _layer_files(self, key: str) -> list[str]:
        return [f for f in self.layer_files if Path(f).name.startswith(key + "-")]

    def _check_tp(self, tp_index: int) -> None:
        if not 0 <= tp_index < self.tp_degree:
            raise AssertionError(f"tp_index {tp_index} is outside tensor degree {self.tp_degree}")

    def _tp_files(self, key: str, tp_index: int) -> list[str]:
        self._check_tp(tp_index)
        found = self._layer_files(key)
        per_rank = max(1, len(found) // self.tp_degree)
        return found[tp_index * per_rank : (tp_index + 1) * per_rank]

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list[str]:
        return self._tp_files(self.get_embedding_layer_id(), tp_index)

    def get_final_norm_files(self, tp_index: int) -> list[str]:
        return self._tp_files(self.get_final_norm_layer_id(), tp_index)

    def get_embedding_state(self, tp_index: int) -> dict:
        return files.read_checkpoint(Path(self.get_embedding_files(tp_index)[0]))

    def get_final_norm_state(self, tp_index: int) -> dict:
        return files.read_checkpoint(Path(self.get_final_norm_files(tp_index)[0]))

    def get_pp_transformer_map(self, pp_index: int) -> list[str]:
        """The transformer layers (every layer but the embedding and the final norm) of pipeline stage
        `pp_index`, spread evenly over `pp_degree` stages."""
        if not 0 <= pp_index < self.pp_degree:
            raise AssertionError(f"pp_index {pp_index} is outside pipeline degree {self.pp_degree}")
        layers = self.layer_keys[1 : self.final_layer_norm_idx]
        per_stage = len(layers) // self.pp_degree
        return layers[pp_index * per_stage : (pp_index + 1) * per_stage]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list[dict]:
        return [
            files.read_checkpoint(Path(self._tp_files(key, tp_index)[0]))
            for key in self.get_pp_transformer_map(pp_index)
        ]

    # -- model-states and partition files of a rank ------------------------------------------------------------

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        self._check_tp(tp_index)
        if self.is_change_pp_degree():
            raise NotOfferedError(
                "DeepSpeedCheckpoint.get_2d_parallel_files at another pipeline degree: Megatron's model-states files "
                "are not merged here"
            )
        return [self.mp_rank_files[pp_index * self.tp_degree + tp_index]]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict:
        return files.read_checkpoint(Path(self.get_2d_parallel_files(tp_index, pp_index)[0]))

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        mp_rank = pp_index * self.src_tp_degree + tp_index
        return [
            f
            for f in self.file_list
            if (m := _ZERO_FILE.fullmatch(Path(f).name))
            and (int(m.group(1)), int(m.group(2))) == (dp_index, mp_rank)
        ]

    def get_zero_checkpoint_state(
        self, pp_index, tp_index, dp_index, strip_tensor_paddings: bool = True
    ) -> dict:
        raise NotOfferedError(
            "DeepSpeedCheckpoint.get_zero_checkpoint_state returns DeepSpeed's ZeRO partition layout "
            "(base_optimizer_state, single_partition_of_fp32_groups, param_slice_mappings), which shardspeed's "
            "partition files do not have: read values by parameter name with shardspeed.checkpoint.CheckpointReader, "
            "or write the by-name universal layout with ds_to_universal"
        )
