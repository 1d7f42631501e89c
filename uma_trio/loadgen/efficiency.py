"""Scheduler efficiency: the engine time a run's work needs at the engine's capacity, over
the time the server had that work.

The capacity is measured without a server by ``llama-batched-bench`` (``benches/compare.py``
runs it): ``prefill`` maps a prompt length to its prefill tokens/s (S_PP at one sequence),
``decode`` maps a number of sequences decoding together to their aggregate tokens/s (S_TG).
From the client's records alone, the same for every server:

* the busy time is the union of the requests' spans, from send to end: the time the server
  had work waiting, so idle engine time inside it counts against the scheduler;
* the ideal time prices each generated token at the decode rate of the number of requests
  that were decoding when it arrived, and each prompt at its prefill cost, counting only the
  tokens past the longest prompt sent before it (an engine that kept every prompt; the
  synthetic prompts are prefixes of one another, so this is the least any cache can leave).

``efficiency = ideal / busy``: 1.0 would be the engine's measured best for the very tokens the
clients asked for, at the concurrency they asked for them.  Pure functions; no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .records import RequestRecord


@dataclass(frozen=True)
class Capacity:
    prefill: Mapping[int, float]  # prompt length -> prefill tokens/s (one sequence)
    decode: Mapping[int, float]  # sequences decoding together -> aggregate tokens/s

    def prefill_seconds(self, length: int) -> float:
        """Seconds to prefill a prompt of ``length`` tokens from nothing (interpolated)."""
        points = [(0, 0.0), *sorted((n, n / rate) for n, rate in self.prefill.items() if rate > 0)]
        return _interpolate(points, length)

    def decode_seconds_per_token(self, decoders: int) -> float:
        """Seconds one token costs when ``decoders`` sequences decode together."""
        points = sorted((n, n / rate) for n, rate in self.decode.items() if rate > 0)
        return _interpolate(points, max(1, decoders)) / max(1, decoders)


def best_of(passes: Sequence[Capacity]) -> Capacity:
    """Each point's best over ``passes``: on a shared machine noise only ever slows the engine
    (one run's decode figures at 2-3 sequences moved by 40 % between two passes)."""
    prefill: dict[int, float] = {}
    decode: dict[int, float] = {}
    for one in passes:
        for n, v in one.prefill.items():
            prefill[n] = max(prefill.get(n, 0.0), v)
        for n, v in one.decode.items():
            decode[n] = max(decode.get(n, 0.0), v)
    return Capacity(prefill=prefill, decode=decode)


def _interpolate(points: Sequence[tuple[int, float]], x: int) -> float:
    """Piecewise-linear through ``points`` (sorted by x), extended by the last segment's slope."""
    if not points:
        raise ValueError("no capacity measured")
    if len(points) == 1:
        px, py = points[0]
        return py * x / px if px else py
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def busy_seconds(records: Iterable[RequestRecord]) -> float:
    """The union of the requests' spans (send to end)."""
    spans = sorted((r.sent, r.ended) for r in records if r.ended is not None)
    total, start, end = 0.0, None, None
    for sent, ended in spans:
        if end is None or sent > end:
            if start is not None and end is not None:
                total += end - start
            start, end = sent, ended
        else:
            end = max(end, ended)
    if start is not None and end is not None:
        total += end - start
    return total


def ideal_seconds(
    records: Sequence[RequestRecord], capacity: Capacity, prompt_of: Mapping[str, int]
) -> float:
    """Engine seconds the records' work needs at ``capacity`` (module docstring)."""
    done = [r for r in records if r.ended is not None]
    seconds, longest = 0.0, 0
    for record in sorted(done, key=lambda r: r.sent):
        length = record.prompt_tokens or prompt_of.get(record.client, 0)
        if length > longest:
            seconds += capacity.prefill_seconds(length) - capacity.prefill_seconds(longest)
            longest = length
    # A request decodes from its first token to its end.
    starts = sorted(r.token_times[0] for r in done if r.token_times)
    ends = sorted(r.ended for r in done if r.token_times and r.ended is not None)
    for record in done:
        events = record.token_times[1:]
        # An event may carry several tokens (an OpenAI chunk); price them all.
        tokens = (record.completion_tokens or len(record.token_times)) - 1
        per_event = tokens / len(events) if events else 0.0
        for t in events:
            decoders = bisect.bisect_right(starts, t) - bisect.bisect_left(ends, t)
            seconds += per_event * capacity.decode_seconds_per_token(decoders)
    return seconds


def efficiency(
    records: Sequence[RequestRecord], capacity: Capacity, prompt_of: Mapping[str, int]
) -> float | None:
    busy = busy_seconds(records)
    return round(ideal_seconds(records, capacity, prompt_of) / busy, 3) if busy > 0 else None


def needed_for(
    records: Sequence[RequestRecord], capacity: Capacity, prompt_of: Mapping[str, int], done_by: float
) -> float | None:
    """The efficiency a server needs to end all of ``records``' work by ``done_by`` (on the
    records' clock): that work's ideal time over the time from the first send to ``done_by``.

    A request that has to end last (a background prompt the latency guard cannot read beside
    the chats, benches/guard_bound.py) is due only when the whole load is done, so its
    deadline asks this much of the server; above 1.0 no scheduler on that engine meets it."""
    done = [r for r in records if r.ended is not None]
    if not done:
        return None
    window = done_by - min(r.sent for r in done)
    return round(ideal_seconds(done, capacity, prompt_of) / window, 3) if window > 0 else None
