"""Scripted load scenarios: who connects when, and what each client asks for.

One format serves both the simulation tests (the whole daemon under
``trio.testing.MockClock`` against a simulated engine) and the real-daemon
benchmark, so a scenario tuned in simulation is exactly the one measured for
real.  Scenarios are msgspec Structs: build them in code, from plain dicts
(:func:`scenario_from_dict`) or from JSON files (:func:`load_scenario`); bad
input raises :class:`msgspec.ValidationError`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

Lane = Literal["interactive", "background"]

# The word :func:`prompt_text` repeats.  SmolLM2's tokenizer (the default model) turns
# "hello hello ... hello" into exactly one token per word, and adds no BOS
# (tests/test_loadgen.py checks this on the real model).
PROMPT_WORD = "hello"

# A client's requests are named "NAME-i": printable ASCII with no space, as request ids are.
Name = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[!-~]+$")]
PositiveInt = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(ge=0.0)]
# Each copy is a connection (and a task) of its own: far more than any daemon admits
# (--max-connections), and a typo such as 1e9 was an out-of-memory instead of an error.
MAX_COPIES = 4096


class ClientSpec(Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One client: one connection running ``requests`` requests back to back.

    Each request starts ``think_s`` after the previous one ended (an "agent
    chain"), so a client never has more than one request in flight.  ``copies``
    makes that many identical clients (``name-0``, ``name-1``, ...; at most
    :data:`MAX_COPIES`), the k-th starting ``k * stagger_s`` after ``start_s``.
    """

    name: Name
    lane: Lane = "interactive"
    prompt_tokens: PositiveInt
    max_tokens: PositiveInt
    start_s: Seconds = 0.0  # connect and send the first request this long after the scenario starts
    requests: PositiveInt = 1
    think_s: Seconds = 0.0
    copies: Annotated[int, Meta(ge=1, le=MAX_COPIES)] = 1
    stagger_s: Seconds = 0.0
    model: str | None = None  # which of the daemon's models (docs/MODELS.md); None: its default

    def request_id(self, index: int) -> str:
        return f"{self.name}-{index}"

    def request(self, index: int) -> dict[str, Any]:
        """The wire request for this client's ``index``-th request.

        A raw ``prompt`` (no chat template, so its token count is known), greedy,
        no stop strings (so generation runs to ``max_tokens`` unless the model
        emits end-of-generation), streamed, in the client's lane.
        """
        return {
            "id": self.request_id(index),
            "prompt": prompt_text(self.prompt_tokens),
            "max_tokens": self.max_tokens,
            "stream": True,
            "temperature": 0.0,
            "stop": [],
            "priority": self.lane,
            **({"model": self.model} if self.model is not None else {}),
        }


class Scenario(Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    name: Name
    clients: Annotated[list[ClientSpec], Meta(min_length=1)]

    def __post_init__(self) -> None:
        # Names key the results (and the request ids); duplicates would merge two clients.
        counts = Counter(c.name for c in self.expanded().clients)  # names.count was quadratic
        duplicates = sorted(n for n, k in counts.items() if k > 1)
        if duplicates:
            raise ValueError(f"duplicate client names: {', '.join(duplicates)}")

    def expanded(self) -> Scenario:
        """The same scenario with every client's ``copies`` written out as clients."""
        if all(c.copies == 1 for c in self.clients):
            return self
        clients: list[ClientSpec] = []
        for spec in self.clients:
            if spec.copies == 1:
                clients.append(spec)
                continue
            for k in range(spec.copies):
                clients.append(
                    msgspec.structs.replace(
                        spec,
                        name=f"{spec.name}-{k}",
                        copies=1,
                        stagger_s=0.0,
                        start_s=spec.start_s + k * spec.stagger_s,
                    )
                )
        return msgspec.structs.replace(self, clients=clients)

    def without_lane(self, lane: Lane) -> Scenario:
        """The scenario with ``lane``'s clients left out (e.g. the interactive clients alone)."""
        kept = [c for c in self.clients if c.lane != lane]
        return msgspec.structs.replace(self, name=f"{self.name}-alone", clients=kept)

    def client(self, name: str) -> ClientSpec:
        for spec in self.expanded().clients:
            if spec.name == name:
                return spec
        raise KeyError(name)


def prompt_text(n_tokens: int) -> str:
    """A prompt of ``n_tokens`` tokens for both engines.

    The simulated engine counts one token per whitespace-separated word; the
    real SmolLM2 tokenizer gives one token per repetition of ``"hello"``.
    """
    if n_tokens < 1:
        raise ValueError("a prompt needs at least one token")
    return " ".join([PROMPT_WORD] * n_tokens)


def scenario_from_dict(data: Any) -> Scenario:
    """Validate a plain dict (e.g. parsed JSON) into a :class:`Scenario`."""
    return msgspec.convert(data, Scenario)


def load_scenario(path: Path) -> Scenario:
    """Read a scenario from a JSON file."""
    return msgspec.json.decode(path.read_bytes(), type=Scenario)


class Suite(Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A benchmark: scenarios run one after the other on each target.

    ``alone``: also run every scenario without its background clients first,
    and report the interactive gaps relative to that run (the seeds' mixed-load
    comparison).
    """

    name: Name
    description: str = ""
    runs: list[Scenario] = msgspec.field(default_factory=list)
    alone: bool = False
    skip: str | None = None  # why this benchmark cannot run here (printed instead of running it)

    def __post_init__(self) -> None:
        names = [r.name for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError("scenario names in a suite must differ")
        if not self.runs and self.skip is None:
            raise ValueError("a suite needs at least one run (or a `skip` reason)")


def load_suite(path: Path) -> Suite:
    """Read a benchmark from a JSON file: a :class:`Suite`, or one bare :class:`Scenario`."""
    data = msgspec.json.decode(path.read_bytes())
    if isinstance(data, dict) and ("runs" in data or "skip" in data):
        return msgspec.convert(data, Suite)
    scenario = msgspec.convert(data, Scenario)
    return Suite(name=scenario.name, runs=[scenario])


def mixed_scenario(
    bg_prompt_tokens: int | None, interactive_tokens: int, *, interactive_requests: int = 5
) -> Scenario:
    """Three chatty interactive clients, optionally with one long-prompt background job.

    The interactive clients (~30-token prompts, ``interactive_tokens`` each)
    chain ``interactive_requests`` requests with no think time, so they keep
    streaming past the end of the background request; that request
    (``bg_prompt_tokens`` of prompt, 32 tokens out) arrives at t = 2 s.  With
    ``bg_prompt_tokens=None`` it is left out: the baseline.  Shared by the
    simulation tests and ``benches/mixed_scenario.py``.
    """
    clients = [
        ClientSpec(
            name=f"interactive-{i}",
            lane="interactive",
            prompt_tokens=30,
            max_tokens=interactive_tokens,
            requests=interactive_requests,
        )
        for i in range(3)
    ]
    if bg_prompt_tokens is not None:
        clients.append(
            ClientSpec(
                name="background",
                lane="background",
                prompt_tokens=bg_prompt_tokens,
                max_tokens=32,
                start_s=2.0,
            )
        )
    suffix = "baseline" if bg_prompt_tokens is None else f"bg{bg_prompt_tokens}"
    return Scenario(name=f"mixed-{suffix}", clients=clients)
