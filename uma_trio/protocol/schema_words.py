"""msgspec's refusals of a pattern, said in words.

msgspec names a string pattern by its regex, repr'd, so a client read
``matching regex '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\\\\Z'`` (backslashes doubled) for a bad
snapshot name; the patterns the protocol uses are described instead.
"""

from __future__ import annotations

import re
from typing import Any, get_args

from .messages import RequestId, SnapshotName, TokenKey
from .tools import FunctionName


def _pattern(annotated: Any) -> str:
    return str(get_args(annotated)[1].pattern)


_WORDS = {
    _pattern(RequestId): "of 1-128 printable ASCII characters (no spaces)",
    _pattern(SnapshotName): "of 1-64 letters, digits, '.', '_' and '-', starting with a letter or a digit",
    _pattern(TokenKey): "holding a token id (1-9 digits)",
    _pattern(FunctionName): "of 1-64 letters, digits, '_', '.' and '-'",
}


def readable(message: str) -> str:
    """``message`` (a msgspec ValidationError's) with each known pattern in words."""
    for pattern, words in _WORDS.items():
        message = message.replace(f"matching regex {pattern!r}", words)
    return message


# A \uD800-\uDBFF escape with no low half after it: msgspec says "Input data was truncated"
# for it (the body was whole), which sent clients looking for a cut-off body.
_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])")


def json_fault(exc: Exception, data: bytes) -> str:
    """A msgspec DecodeError's message for ``data``, a lone high surrogate named as such."""
    message = str(exc)
    if message == "Input data was truncated" and _LONE_HIGH_SURROGATE.search(data):
        return "invalid utf-16 surrogate pair: a \\uD800-\\uDBFF escape with no low half after it"
    return message
