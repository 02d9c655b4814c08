"""How Evoformer attention is cut into blocks: sequences per block and query rows per block.

One block's logits are [batch, seq_chunk, heads, query_chunk, n_res] numbers; forward and backward hold
about `WORKING_COPIES` tensors of that size at a time (the logits turned into probabilities in place, and in
backward the gradient of the probabilities turned into the gradient of the logits in place, plus one
temporary), so the block is sized to keep that working set under a memory target:

- default: max(floor, the bytes of Q), the floor 8 MiB on the CPU and 256 MiB on CUDA. The attention then
  needs about one more input's worth of memory beyond its inputs, outputs and gradients, instead of the
  [batch, n_seq, heads, n_res, n_res] logits and probabilities a plain implementation holds. On the CPU the
  time hardly depends on the block size, so blocks are small; on a GPU small blocks leave it waiting on
  kernel launches (one H200, bf16, Q [1, 128, 1024, 4, 32], forward + backward: a 32 MiB target 77 ms and
  177 MiB, 64 MiB 29 ms / 218 MiB, 256 MiB 12 ms / 361 MiB, 1 GiB 10 ms / 894 MiB; the plain op 11 ms and
  4.2 GiB, SDPA over all sequences at once 7 ms and 2.3 GiB);
- `SHARDSPEED_EVOFORMER_CHUNK_MB` (environment): the target in MiB;
- `chunk_size` / `query_chunk_size` (arguments of `DS4Sci_EvoformerAttention`): the block sizes themselves.

Blocks are whole sequences first; query rows are split only when a single sequence is over the target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["CHUNK_MB_ENV", "ChunkPlan", "memory_target_bytes", "plan_chunks"]

CHUNK_MB_ENV = "SHARDSPEED_EVOFORMER_CHUNK_MB"
DEFAULT_FLOOR_BYTES = {"cpu": 8 * 2**20, "cuda": 256 * 2**20}  # other devices: the CPU's
WORKING_COPIES = 3


@dataclass(frozen=True)
class ChunkPlan:
    """Block sizes along n_seq (dimension 1) and along the query rows (dimension 2)."""

    seq_chunk: int
    query_chunk: int

    def seq_slices(self, n_seq: int) -> list[tuple[int, int]]:
        return _slices(n_seq, self.seq_chunk)

    def query_slices(self, n_res: int) -> list[tuple[int, int]]:
        return _slices(n_res, self.query_chunk)


def _slices(length: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(length, start + step)) for start in range(0, length, step)]


def check_chunk_argument(name: str, value) -> int | None:
    """None, or a positive int; anything else is refused with an error naming the argument."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


def memory_target_bytes(q_nbytes: int, device_type: str = "cpu") -> int:
    """The working-set target of one block: the environment's, else max(the device's floor, bytes of Q)."""
    raw = os.environ.get(CHUNK_MB_ENV)
    if raw is None or raw == "":
        return max(DEFAULT_FLOOR_BYTES.get(device_type, DEFAULT_FLOOR_BYTES["cpu"]), q_nbytes)
    try:
        mib = float(raw)
    except ValueError:
        mib = float("nan")
    if not mib > 0 or mib == float("inf"):
        raise ValueError(f"{CHUNK_MB_ENV} must be a positive number of MiB, got {raw!r}")
    return int(mib * 2**20)


def plan_chunks(
    shape: tuple[int, ...],
    compute_itemsize: int,
    target_bytes: int,
    chunk_size: int | None = None,
    query_chunk_size: int | None = None,
) -> ChunkPlan:
    """Block sizes for Q of `shape` = [batch, n_seq, n_res, heads, dim] whose logits are computed with
    `compute_itemsize` bytes per number; explicit sizes win (clamped to the tensor)."""
    batch, n_seq, n_res, heads, _ = shape
    row_bytes = WORKING_COPIES * batch * heads * n_res * compute_itemsize  # one query row of one sequence
    per_sequence = row_bytes * n_res
    if chunk_size is not None:
        seq_chunk = min(chunk_size, n_seq)
    else:
        seq_chunk = max(1, min(n_seq, target_bytes // per_sequence))
    if query_chunk_size is not None:
        query_chunk = min(query_chunk_size, n_res)
    elif seq_chunk == 1 and per_sequence > target_bytes:
        query_chunk = max(1, min(n_res, target_bytes // row_bytes))
    else:
        query_chunk = n_res
    return ChunkPlan(seq_chunk=seq_chunk, query_chunk=query_chunk)
