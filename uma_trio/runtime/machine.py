"""What a model's decode loop shares with the other loaded models' loops: the machine their
steps take turns on, and the arbiter that says when a model with only background work may
take a tick inside another model's stream gap (sched/arbiter.py, docs/MODELS.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from ..sched.arbiter import Arbiter


@dataclass
class LastStep:
    """Which model's step the machine ran last, and when it ended (None: none yet)."""

    model: str | None = None
    end: float | None = None


@dataclass(frozen=True)
class Machine:
    """One per daemon with several models: every loop's steps hold ``turns`` while they run."""

    arbiter: Arbiter
    turns: trio.StrictFIFOLock = field(default_factory=trio.StrictFIFOLock)
    last: LastStep = field(default_factory=LastStep)

    def share(self, model: str) -> MachineShare:
        return MachineShare(model, self.arbiter, self.turns, self.last)


@dataclass(frozen=True)
class MachineShare:
    """One model's loop's part: its name to the arbiter, and the machine's turns."""

    name: str
    arbiter: Arbiter
    machine: trio.StrictFIFOLock
    last: LastStep  # the machine's, shared: a step of another model is no idle time of this one
