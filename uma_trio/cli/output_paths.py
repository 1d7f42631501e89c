"""The files and directories ``serve`` writes to, checked before the model loads.

``--tick-trace`` in a missing directory (or naming a directory) ended in a traceback once the
model had loaded, and a ``--scorecard-csv`` there or a ``--snapshot-dir`` that is a file were
taken and failed later, each in the middle of serving.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ConfigError, ServerConfig


def _appendable_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be appended to (it is created, empty, when missing)."""
    if path.is_dir():
        return "is a directory"
    if not path.parent.is_dir():
        return f"is in {path.parent}, which is not a directory that exists"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return f"cannot be opened for appending ({exc.strerror})"
    os.close(fd)
    return None


def check_output_paths(config: ServerConfig) -> None:
    """:class:`ConfigError` naming the flag whose path the daemon could not write to."""
    files = {"--tick-trace": config.tick_trace, "--scorecard-csv": config.scorecard_csv}
    for flag, path in files.items():
        if path is not None and (problem := _appendable_file_problem(path)) is not None:
            raise ConfigError(f"{flag} {path} {problem}")
    directory = config.snapshot_dir
    if directory is not None and os.path.lexists(directory) and not directory.is_dir():
        raise ConfigError(f"--snapshot-dir {directory} is not a directory")
