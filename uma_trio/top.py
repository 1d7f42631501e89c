"""``uma-trio top``: poll the daemon's metrics over one connection and redraw (rich ``Live``)."""

from __future__ import annotations

from pathlib import Path

import trio
from rich.console import Console
from rich.live import Live

from .client import UmaClient
from .observability.views import dashboard
from .pipe_console import PipeConsole


async def run_top(socket: Path, interval: float, once: bool = False, console: Console | None = None) -> None:
    console = console or PipeConsole()
    async with UmaClient.connect(socket) as client:
        frame = dashboard(await client.metrics())
        if once:
            console.print(frame)
            return
        if not console.is_terminal:  # `top | tee`, a log: a frame each interval, as `top -b`
            while True:
                with console.capture() as drawn:  # rich exits 1 on a closed pipe: write it here
                    console.print(frame)
                console.file.write(drawn.get())
                console.file.flush()  # BrokenPipeError when the reader is gone (`| head`)
                await trio.sleep(interval)
                frame = dashboard(await client.metrics())
        # The metrics request is answered by the connection task, never behind a decode
        # tick, so the view keeps refreshing while a long prompt is being prefilled.
        with Live(frame, console=console, screen=True, auto_refresh=False) as live:
            while True:
                await trio.sleep(interval)
                live.update(dashboard(await client.metrics()), refresh=True)
