"""The batch-size triple: DeepSpeed's inference rules (reference §2.1) with errors that show the arithmetic.

    train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size

Given two of the three, the third is derived with integer floor division, exactly as DeepSpeed does
(so a non-divisible pair is caught by the final equality check, with the derivation shown).
"""

from __future__ import annotations

from .errors import ConfigError

__all__ = ["resolve_batch_sizes"]

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


def resolve_batch_sizes(
    train: int | None, micro: int | None, gas: int | None, world_size: int
) -> tuple[int, int, int]:
    """Return ``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``.

    ``None`` means "not given". Raises ``ConfigError`` naming the keys when the values are missing,
    not positive, or inconsistent with ``world_size``.
    """
    for name, value in ((TRAIN, train), (MICRO, micro), (GAS, gas), ("world size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
    if train is None and micro is None:
        given = f" ({GAS} alone is not enough)" if gas is not None else ""
        raise ConfigError(
            f"{TRAIN} and {MICRO}: neither is given{given}; set at least one of them "
            f'(e.g. "{MICRO}": 8 and "{GAS}": 1)'
        )
    derived, resolved = _derive(train, micro, gas, world_size)
    _check_positive(derived, resolved, world_size)
    _check_product(derived, *resolved, world_size)
    return resolved


def _derive(
    train: int | None, micro: int | None, gas: int | None, world: int
) -> tuple[str | None, tuple[int, int, int]]:
    """Fill in the missing values; returns the name of the derived key (None if all three were given)."""
    if train is not None and micro is not None and gas is not None:
        return None, (train, micro, gas)
    if train is not None and micro is not None:
        return GAS, (train, micro, train // micro // world)
    if train is not None and gas is not None:
        return MICRO, (train, train // world // gas, gas)
    if micro is not None and gas is not None:
        return TRAIN, (micro * gas * world, micro, gas)
    if train is not None:
        return MICRO, (train, train // world, 1)
    assert micro is not None
    return TRAIN, (micro * world, micro, 1)


def _check_positive(derived: str | None, resolved: tuple[int, int, int], world: int) -> None:
    train, micro, gas = resolved
    if derived == GAS and gas <= 0:
        raise ConfigError(
            f"{GAS}: derived as {TRAIN} ({train}) // {MICRO} ({micro}) // world size ({world}) = {gas}; "
            f"{TRAIN} must be at least {MICRO} * world size = {micro * world}"
        )
    if derived == MICRO and micro <= 0:
        raise ConfigError(
            f"{MICRO}: derived as {TRAIN} ({train}) // world size ({world}) // {GAS} ({gas}) = {micro}; "
            f"{TRAIN} must be at least {GAS} * world size = {gas * world}"
        )


def _check_product(derived: str | None, train: int, micro: int, gas: int, world: int) -> None:
    product = micro * gas * world
    if train == product:
        return

    def term(name: str, value: int) -> str:
        return f"{name} ({value}, derived)" if name == derived else f"{name} ({value})"

    raise ConfigError(
        f"{term(TRAIN, train)} != {term(MICRO, micro)} * {term(GAS, gas)} * world size ({world}) = {product}. "
        f"Hint: give two of the three keys and let the third be derived, and make {TRAIN} a multiple of "
        f"{MICRO} * world size ({micro * world}); e.g. {TRAIN} = {product}"
    )
