"""Ollama's ``keep_alive``: seconds, or a Go-style duration (``"5m"``, ``"1h30m"``, ``"-1"``),
as a number of seconds.  Pure."""

from __future__ import annotations

import math
import re
from typing import Any

from .openai_errors import bad_request

_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


KEEP_ALIVE_MAX_S = 365 * 86400.0  # a year: past it a timedelta in /api/ps could overflow


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number of seconds or a duration (``"5m"``,
    ``"1h30m"``, ``"-1"``); negative keeps the model for good, 0 unloads it after the request;
    None when not given.  Anything else is a 400 naming the field."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise bad_request(f"keep_alive must be a duration or seconds, not {value!r}", "keep_alive")
    total = _duration_s(value) if isinstance(value, str) else _number_s(value)
    if not math.isfinite(total) or total > KEEP_ALIVE_MAX_S:
        raise bad_request(
            f"keep_alive {value!r} is longer than a year; a negative value keeps the model for good",
            "keep_alive",
        )
    return total


def _number_s(value: int | float) -> float:
    """Seconds as a float: an integer past a float's range (hundreds of digits) is refused,
    not an OverflowError answered as a 500."""
    try:
        return float(value)
    except OverflowError:
        raise bad_request(
            "keep_alive is out of range: give at most a year in seconds", "keep_alive"
        ) from None


def _duration_s(value: str) -> float:
    """A duration's seconds; an empty or blank one is refused, as Go's ``ParseDuration("")``
    does (it read as 0, which unloads the model)."""
    total, rest = 0.0, value.strip()
    if not rest:
        raise bad_request(
            f"keep_alive {value!r} is empty: give a duration such as 5m, 1h or -1", "keep_alive"
        )
    while rest:
        found = _DURATION.match(rest)
        if found is None or not found.group(0):
            message = f"keep_alive {value!r} is not a duration such as 5m, 1h or -1"
            raise bad_request(message, "keep_alive")
        total += float(found.group(1)) * _UNIT_S[found.group(2)]
        rest = rest[found.end() :]
    return total
