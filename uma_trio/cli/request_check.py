"""A client command's request checked before it is sent, with the protocol's own types.

Left to the daemon, ``generate --max-tokens 0`` came back as its refusal (exit 2, naming the
wire field ``$.max_tokens``) where a bad option is the user's (exit 1, naming the flag), and a
bad snapshot name was first seen by the daemon.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from ..protocol.schema_words import readable

_AT = re.compile(r" - at `\$\.([A-Za-z_]+)([^`]*)`$")


def option_problem(request: dict[str, Any], kind: type, flags: dict[str, str]) -> str | None:
    """Why ``request`` is no ``kind`` (a protocol message), naming the flag (``flags``: wire
    field → flag) that set the field at fault; None when it converts."""
    try:
        msgspec.convert({"id": "cli", **request}, type=kind)
    except msgspec.ValidationError as exc:
        message = readable(str(exc))
        if (found := _AT.search(message)) is None:
            return message
        field, rest = found.groups()
        where = f" (at {field}{rest})" if rest else ""
        return f"{flags.get(field, field)}: {message[: found.start()]}{where}"
    return None
