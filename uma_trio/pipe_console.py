"""A rich console whose reader may go away: a closed pipe (``uma-trio metrics | head``) ends
the command as every other closed pipe does, with exit 141 (cli.main), not rich's exit 1."""

from __future__ import annotations

from rich.console import Console


class PipeConsole(Console):
    def on_broken_pipe(self) -> None:
        """Rich's own exits 1, the code of a bad option; the caller's handler says 141."""
        self.quiet = True
        raise BrokenPipeError
