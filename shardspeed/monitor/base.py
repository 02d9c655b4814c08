"""What every monitor backend shares: the event type, the `Monitor` interface they implement, and the
error for a backend whose optional package is missing. The backends import it from here, and
`monitor.MonitorMaster` composes them, so neither side imports the other's module to reach it."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Event", "Monitor", "missing_extra"]

Event = tuple[str, float, int]


class Monitor(Protocol):
    """A backend: writes a batch of events, flushes, closes. The backends here subclass it by name;
    `MonitorMaster` accepts anything with these two methods."""

    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def missing_extra(block: str, package: str, extra: str) -> ImportError:
    """The error for an enabled monitor whose optional package is not installed."""
    return ImportError(
        f"{block}.enabled is true but the '{package}' package is not installed; "
        f"install it with: pip install 'shardspeed[{extra}]'"
    )
