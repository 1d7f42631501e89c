"""How much background prompt work the latency guard leaves room for: an upper bound from a
tick trace.  Pure: the trace's ticks in, figures out (``benches/guard_bound.py`` reads the
files and prints them).

The guard (issue 19): while interactive streams decode, their gaps stay within 1.2× the same
chats' gap p95 when they run alone at the 95th percentile and within 2× at most.  Every tick
that carries an interactive decode token is such a gap.  So, given the ticks of a real run:

* a tick with ``k`` interactive decoders and ``n`` background prompt tokens takes at least
  :func:`step_floor` ``(k, n)``: the fastest step the trace measured with at most ``k``
  decoders and at most ``n`` (≥ 1) prompt tokens (a step does not get faster with more
  tokens), at least ``n`` tokens at the fastest prefill rate measured (in the trace, or by
  the engine alone), and, where the engine's capacity was measured (``llama-batched-bench``,
  no server), at least the decode step of ``k + n`` sequences there (a prompt token is a
  batch column like a decode token: the kernels, and on the CPU their staircase, follow the
  batch's width);
* the chats' ticks run one after another, so a tick made longer by prompt tokens takes that
  time from the rest of the window: the time no chat decodes is at most the window less
  every chat tick's floor, read at the fastest prefill rate, and prompt tokens beside the
  chats count only for what they add over that (:func:`beside_gain`);
* all but 5 % of the chats' gaps (over the whole run, a tick with ``k`` chats decoding being
  ``k`` gaps) must stay within ``1.2 × alone p95``, the rest within ``2 × alone p95``: each
  tick carries at most the prompt tokens whose floor fits, the largest gain per gap going to
  the ticks that may stretch, all of them inside the window if it has them.

Every figure is taken in the scheduler's favour (fastest steps, every tick filled to the
limit, no time between steps, prompts read at the engine's best rate) but one: the chats keep
the pace they had in the run, their ticks where the run had them, each a token for every chat
decoding then.  So when the background prompts' tokens exceed what this allows by their
deadline (:attr:`Verdict.short`), no scheduler within the guard that keeps the chats at their
pace meets it on that machine.  One that slowed the chats themselves, stretching every tick
toward the p95 cap and letting their turns run past the deadline, is outside the bound: it
trades the chats' own tokens (and, with the clients' spread on top of the stretched ticks, the
p95 itself) for the background's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

P95_CAP = 1.2  # gap p95 over the chats-alone p95
MAX_CAP = 2.0  # gap max over the chats-alone p95
SLACK = 0.05  # the share of the run's gaps the p95 leaves free to stretch to the max


@dataclass(frozen=True)
class TraceTick:
    """One line of ``--tick-trace``: when its step ended, what it carried, what it took."""

    end_s: float
    decoders: int
    prompt_tokens: int
    step_s: float
    interactive: bool  # interactive streams decoded in it (the trace's cap_ms > 0)

    @property
    def start_s(self) -> float:
        return self.end_s - self.step_s


def last_daemon(lines: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The lines the last daemon wrote: ``--tick-trace`` appends to its file, and each daemon
    counts its ticks from 0 on its own clock."""
    starts = [i for i in range(1, len(lines)) if lines[i]["tick"] < lines[i - 1]["tick"]]
    return list(lines[starts[-1] :] if starts else lines)


def ticks_from_trace(lines: Iterable[Mapping[str, Any]]) -> list[TraceTick]:
    """The ticks of ``--tick-trace`` lines (runtime/tick_trace.py), parsed."""
    return [
        TraceTick(
            end_s=float(row["t"]), decoders=int(row["decode"]), prompt_tokens=int(row["prefill"]),
            step_s=float(row["step_ms"]) / 1000.0, interactive=float(row["cap_ms"]) > 0.0,
        )
        for row in lines
    ]  # fmt: skip


@dataclass(frozen=True)
class Floors:
    """The fastest steps a trace measured, for :func:`step_floor`."""

    decode_only: dict[int, float]  # decoders -> fastest decode-only step
    with_prompt: dict[tuple[int, int], float]  # (decoders, prompt tokens) -> fastest step
    prefill_rate: float  # the most prompt tokens a second any step read
    batch_steps: dict[int, float]  # engine capacity: sequences decoding together -> their step


def floors_of(
    ticks: Sequence[TraceTick], batch_steps: dict[int, float] | None = None,
    prefill_rates: dict[int, float] | None = None,
) -> Floors:  # fmt: skip
    """The trace's fastest steps, and where the engine alone was measured (``batch_steps``:
    sequences -> step s; ``prefill_rates``: prompt length -> tokens/s), those as well."""
    decode_only: dict[int, float] = {}
    with_prompt: dict[tuple[int, int], float] = {}
    rate = max((prefill_rates or {}).values(), default=0.0)
    for t in ticks:
        if t.step_s <= 0.0:
            continue
        if t.prompt_tokens == 0:
            decode_only[t.decoders] = min(decode_only.get(t.decoders, math.inf), t.step_s)
        else:
            key = (t.decoders, t.prompt_tokens)
            with_prompt[key] = min(with_prompt.get(key, math.inf), t.step_s)
            rate = max(rate, t.prompt_tokens / t.step_s)
    if rate <= 0.0:
        raise ValueError("the trace has no step that read prompt tokens")
    return Floors(decode_only, with_prompt, rate, dict(batch_steps or {}))


def step_floor(floors: Floors, decoders: int, prompt_tokens: int) -> float:
    """The least a step of ``decoders`` decode tokens and ``prompt_tokens`` prompt tokens can
    take, by the trace (see the module docstring)."""
    slower = [s for k, s in floors.decode_only.items() if 0 < k <= decoders]
    floor = max(slower, default=0.0)
    if prompt_tokens > 0:
        measured = [s for (k, n), s in floors.with_prompt.items() if k <= decoders and n <= prompt_tokens]
        floor = max(floor, max(measured, default=0.0), prompt_tokens / floors.prefill_rate)
        width = decoders + prompt_tokens
        narrower = [s for n, s in floors.batch_steps.items() if n <= width]
        floor = max(floor, max(narrower, default=0.0))
    # Never above a step the trace measured doing at least as much: single noisy samples of
    # smaller batches must not raise the floor past what a real step took.
    more = [s for (k, n), s in floors.with_prompt.items() if k >= decoders and n >= prompt_tokens]
    if prompt_tokens == 0:
        more += [s for k, s in floors.decode_only.items() if k >= decoders]
    return min(floor, min(more, default=floor))


def tokens_within(floors: Floors, decoders: int, limit_s: float, most: int = 1 << 16) -> int:
    """The most prompt tokens a step beside ``decoders`` decode tokens carries within ``limit_s``."""
    lo, hi = 0, most
    while lo < hi:  # the floor only grows with tokens
        mid = (lo + hi + 1) // 2
        if step_floor(floors, decoders, mid) <= limit_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Room:
    """What the guard leaves background prompts inside one window of a run."""

    window_s: float
    interactive_ticks: int
    free_s: float  # the window less the fastest decode-only step of every interactive tick
    free_tokens: int  # prompt tokens that time holds at the fastest prefill rate
    beside_gain: int  # what prompt tokens beside the chats add over spending their time free

    @property
    def tokens(self) -> int:
        return self.free_tokens + self.beside_gain


def beside_gain(floors: Floors, decoders: int, limit_s: float, free_rate: float | None = None) -> int:
    """The most a tick beside ``decoders`` interactive decoders, within ``limit_s``, adds by
    carrying prompt tokens: ``n`` tokens, less what the time it grows by would have read
    with no chat decoding, at ``free_rate`` (the chats' ticks run one after another, so a
    longer tick is time taken from the rest of the window)."""
    rate = free_rate or floors.prefill_rate
    base, most = step_floor(floors, decoders, 0), tokens_within(floors, decoders, limit_s)
    gains = (n - (step_floor(floors, decoders, n) - base) * rate for n in range(most + 1))
    return max(0, math.floor(max(gains)))


def room_in(
    ticks: Sequence[TraceTick], floors: Floors, alone_p95_s: float, start_s: float, end_s: float,
    *, slack_gaps: int | None = None, free_rate: float | None = None,
) -> Room:  # fmt: skip
    """The most background prompt tokens any schedule within the guard reads in
    ``[start_s, end_s)``, the interactive ticks as ``ticks`` had them in it.  Every tick is
    time the window spends: the chats' ticks at least their floor, prompt tokens beside them
    only where that beats reading them in the time they add, with no chat decoding.  The time
    with no chat decoding reads ``free_rate`` tokens a second (default: the trace's fastest).
    ``slack_gaps``: how many of the chats' gaps may stretch past the p95 limit, a tick with
    ``k`` chats decoding stretching ``k`` of them (default: 5 % of the window's own; the p95
    is over the whole run's gaps, and a schedule may spend all of its slack in the window)."""
    rate = free_rate or floors.prefill_rate
    inside = [t for t in ticks if t.interactive and start_s <= t.start_s < end_s]
    p95_limit, max_limit = P95_CAP * alone_p95_s, MAX_CAP * alone_p95_s
    cache: dict[tuple[int, float], int] = {}

    def gain(decoders: int, limit: float) -> int:
        if (decoders, limit) not in cache:
            cache[decoders, limit] = beside_gain(floors, decoders, limit, rate)
        return cache[decoders, limit]

    within = [gain(t.decoders, p95_limit) for t in inside]
    if slack_gaps is None:
        slack_gaps = int(SLACK * sum(t.decoders for t in inside))
    # The stretched ticks: the most gained per gap first, while the gaps last.
    more = sorted(
        ((gain(t.decoders, max_limit) - w, max(1, t.decoders)) for t, w in zip(inside, within, strict=True)),
        key=lambda extra_gaps: extra_gaps[0] / extra_gaps[1], reverse=True,
    )  # fmt: skip
    beside = sum(within)
    for extra, gaps in more:
        if gaps > slack_gaps or extra <= 0:
            continue
        beside += extra
        slack_gaps -= gaps
    busy = sum(step_floor(floors, t.decoders, 0) for t in inside)
    free = max(0.0, (end_s - start_s) - busy)
    return Room(end_s - start_s, len(inside), free, round(free * rate), beside)


@dataclass(frozen=True)
class Background:
    """A background prompt of the scenario: its tokens, when it arrived (trace clock), and the
    latest it may finish (the target ratio × the peer's completion after its arrival)."""

    tokens: int
    arrival_s: float
    deadline_s: float


@dataclass(frozen=True)
class Verdict:
    label: str
    needed: int  # prompt tokens due by the deadline
    room: Room

    @property
    def short(self) -> bool:
        """No schedule within the guard that keeps the chats at their pace reads them in time."""
        return self.needed > self.room.tokens


def prefill_seconds(rates: dict[int, float], tokens: int) -> float:
    """A whole prompt of ``tokens`` at the engine's measured prefill rates (prompt length ->
    tokens/s, ``llama-batched-bench``), linear between the lengths measured."""
    points = sorted(rates.items())
    below = [(n, r) for n, r in points if n <= tokens] or points[:1]
    above = [(n, r) for n, r in points if n >= tokens] or points[-1:]
    (n0, r0), (n1, r1) = below[-1], above[0]
    rate = r0 if n1 == n0 else r0 + (r1 - r0) * (tokens - n0) / (n1 - n0)
    return tokens / rate


def verdicts(
    ticks: Sequence[TraceTick], alone_p95_s: float, prompts: Sequence[Background], *,
    batch_steps: dict[int, float] | None = None, prefill_rates: dict[int, float] | None = None,
    run_start_s: float | None = None,
) -> list[Verdict]:  # fmt: skip
    """For each prompt's deadline: every prompt due by then, over the window from the first
    of them to arrive (a necessary condition: the tokens must fit in that window).  With
    ``prefill_rates`` (the engine alone: prompt length -> tokens/s), the time with no chat
    decoding reads the due prompts at those rates, each whole; else at the trace's fastest.
    With ``run_start_s`` (when the scenario's run began), the p95's slack is 5 % of all the
    run's chat gaps from then on, which a schedule may spend inside the window."""
    floors = floors_of(ticks, batch_steps, prefill_rates)
    slack_gaps = None
    if run_start_s is not None:
        slack_gaps = int(SLACK * sum(t.decoders for t in ticks if t.interactive and t.start_s >= run_start_s))
    out = []
    for i, p in enumerate(sorted(prompts, key=lambda p: p.deadline_s)):
        due = [q for q in prompts if q.deadline_s <= p.deadline_s]
        start = min(q.arrival_s for q in due)
        rate = None
        if prefill_rates:
            rate = sum(q.tokens for q in due) / sum(prefill_seconds(prefill_rates, q.tokens) for q in due)
        room = room_in(ticks, floors, alone_p95_s, start, p.deadline_s, slack_gaps=slack_gaps, free_rate=rate)
        label = f"prompts due by deadline {i + 1} ({', '.join(str(q.tokens) for q in due)} tokens)"
        out.append(Verdict(label, sum(q.tokens for q in due), room))
    return out
