"""DeepSpeed's `deepspeed.utils.numa.parse_range_list`: a core list such as "0,2-4,6" as numbers.

DeepSpeed's rule is stricter than the launcher's `--bind_core_list` parser (which drops duplicates): the
cores must be given in ascending order without overlap, else a ValueError names the list.
"""

from __future__ import annotations

__all__ = ["parse_range_list"]


def parse_range_list(range_str: str) -> list[int]:
    """ "0,2-4,6" -> [0, 2, 3, 4, 6]; ranges and numbers strictly ascending (ValueError otherwise)."""
    cores: list[int] = []
    for part in range_str.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"core list {range_str!r}: {part!r} is not a core number or a range a-b")
        start, end = int(first), int(last) if dash else int(first)
        if end < start:
            raise ValueError(f"core list {range_str!r}: range {part!r} runs backwards")
        if cores and start <= cores[-1]:
            raise ValueError(f"core list {range_str!r}: {part!r} overlaps or precedes core {cores[-1]}")
        cores.extend(range(start, end + 1))
    return cores
