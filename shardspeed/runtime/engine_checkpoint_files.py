"""DeepSpeed's engine helpers for the files around a checkpoint: the `zero_to_fp32.py` recovery script written
beside ZeRO checkpoints (checkpoint/recovery_script.py) and the name of an expert-parallel optimizer file.

Mixed into `ShardspeedEngine`; DeepSpeed code and tests call these private names on the engine.
"""

from __future__ import annotations

import os

from shardspeed.checkpoint import files
from shardspeed.checkpoint.recovery_script import make_executable, write_recovery_script

__all__ = ["CheckpointFiles"]


class CheckpointFiles:
    def _copy_recovery_script(self, save_path) -> None:
        """Write `<save_path>/zero_to_fp32.py`, the consolidation script DeepSpeed leaves beside its ZeRO
        checkpoints (rank 0, after a ZeRO stage 1-3 save)."""
        write_recovery_script(save_path)

    def _change_recovery_script_permissions(self, dst) -> None:
        """Make the recovery script `dst` executable; a file system that refuses (or a missing file) is logged
        with `logger.info` and the save goes on, as in DeepSpeed."""
        make_executable(dst)

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank: int) -> str:
        """The path of expert-parallel rank `expp_rank`'s optimizer file in checkpoint `tag` of DeepSpeed's MoE
        layout at ZeRO stage 0 (`expp_rank_<p>_mp_rank_<T>_optim_states.pt`, T this engine's tensor rank),
        the file shardspeed reads such a checkpoint's optimizer state from."""
        mp_rank = self._checkpoint_placement().mp_rank
        return os.path.join(checkpoints_path, str(tag), files.expert_optim_states_name(expp_rank, mp_rank))
