"""Unwrapping trio's exception groups for one-line error messages."""

from __future__ import annotations


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first plain exception inside ``group`` (nurseries nest groups)."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first
