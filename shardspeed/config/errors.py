"""The one error type every configuration problem raises, and the "did you mean" hint its messages carry
when a name is misspelt (config keys, optimizer and schedule names, their keyword arguments)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A DeepSpeed/shardspeed config is malformed. The message names the key path and the offending value.

    Exported as `shardspeed.DeepSpeedConfigError` too, so `except deepspeed.DeepSpeedConfigError` keeps working.
    """


def closest_name(
    word: str, names: Iterable[str], cutoff: float = 0.6, *, any_case: bool = False
) -> str | None:
    """The name in `names` nearest to `word` (difflib's ratio of at least `cutoff`), or None. With
    `any_case`, a word with no near name as written is matched again in lower case against the lower-cased
    names (and the lower-cased name is returned)."""
    names = list(names)
    close = difflib.get_close_matches(word, names, n=1, cutoff=cutoff)
    if not close and any_case:
        close = difflib.get_close_matches(word.lower(), [n.lower() for n in names], n=1, cutoff=cutoff)
    return close[0] if close else None


def refuse_unknown_keywords(where: str, owner: str, given: Iterable[str], accepted: list[str]) -> None:
    """ConfigError for the first key of `given` that is not in `accepted` (the keyword arguments of the
    class `owner`, read from the config's `where` block), naming the nearest accepted one."""
    for key in given:
        if key not in accepted:
            close = closest_name(key, accepted)
            hint = f"did you mean {close!r}? " if close else ""
            raise ConfigError(
                f"{where}.{key}: not a parameter of {owner}; {hint}accepted: {', '.join(accepted)}"
            )
