"""``uma-trio bench``: run a benchmark suite against targets and print them side by side."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import msgspec
import trio
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .loadgen.bench import (
    expected_tokens,
    failure_tally,
    plan,
    run_bench,
    side_by_side,
    summary_rows,
    write_results,
)
from .loadgen.runner import ScenarioResult
from .loadgen.scenario import Suite, load_suite
from .loadgen.targets import DEFAULT_TIMEOUT_S, Target, parse_target
from .pipe_console import PipeConsole

# Scenario names are looked up under the current directory, then in the checkout this
# package was installed from (an editable install), so `uma-trio bench mixed` works anywhere.
SCENARIO_DIRS = (Path("benches/scenarios"), Path(__file__).resolve().parent.parent / "benches" / "scenarios")


class BenchError(Exception):
    """A bad scenario or target, said in one line."""


def find_suite(name: str) -> Suite:
    """``name`` is a JSON file, or the name of one in benches/scenarios/."""
    path = Path(name)
    if not path.is_file():
        path = next((d / f"{name}.json" for d in SCENARIO_DIRS if (d / f"{name}.json").is_file()), path)
    if not path.is_file():
        known = sorted({p.stem for d in SCENARIO_DIRS for p in d.glob("*.json")})
        raise BenchError(
            f"no scenario {name!r}: give a JSON file or one of {', '.join(known) or '(none here)'}"
        )
    try:
        return load_suite(path)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise BenchError(f"{path}: {exc}") from None


# The exit status after Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130


def run(
    name: str,
    target_specs: list[str],
    *,
    socket_path: Path,
    api_key: str | None,
    out: Path,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> int:
    """Run the suite ``name`` on every target and write what ran: 0 if every request completed,
    1 if any failed (or a target could not be run), 130 if interrupted by Ctrl-C."""
    suite = find_suite(name)
    console = PipeConsole()
    if suite.skip is not None:
        console.print(f"{suite.name}: not run: {suite.skip}")
        return 0
    if not 0 < timeout_s < math.inf:  # NaN too
        raise BenchError("--timeout must be a positive number of seconds")
    try:
        targets: list[Target] = [
            parse_target(t, socket_path=socket_path, api_key=api_key, timeout_s=timeout_s)
            for t in target_specs
        ]
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if len({t.label for t in targets}) != len(targets):
        raise BenchError("two targets have the same label; name them LABEL=...")
    try:  # before the runs: a folder that cannot be made lost them all at the end
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"--out {out}: cannot write the results there ({exc})") from None
    total = sum(expected_tokens(s) for s in plan(suite)) * len(targets)
    columns = (
        TextColumn(suite.name),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
    )
    # Filled in as the runs go: what ran is written whatever stops the bench.
    results: list[ScenarioResult] = []
    target_errors: dict[str, str] = {}
    interrupted = False
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("tokens", total=total)
        try:
            trio.run(
                lambda: run_bench(
                    suite,
                    targets,
                    on_token=lambda: progress.advance(task),
                    into=results,
                    target_errors=target_errors,
                )
            )
        except* KeyboardInterrupt:
            interrupted = True
    if interrupted:
        print("interrupted", file=sys.stderr)
    results = [r for r in results if r.records]  # one interrupted before its first request
    errors = [f"{label}: {message}" for label, message in target_errors.items()]
    if not results:
        if interrupted:
            return EXIT_INTERRUPTED
        if errors:
            raise BenchError("; ".join(errors))
    for error in errors:  # a target that failed as a whole; the others' results follow
        print(f"error: {error}", file=sys.stderr)
    rows = summary_rows(results)
    header, body = side_by_side(rows)
    table = Table(title=f"{suite.name}: {suite.description}" if suite.description else suite.name)
    for column in header:
        table.add_column(column, justify="left" if column in ("scenario", "lane", "figure") else "right")
    for line in body:
        table.add_row(*line)
    console.print(table)
    for failure in failure_tally(results):  # the table counts failures; this says which
        console.print(f"failed: {failure}", markup=False, highlight=False)
    for path in write_results(results, out):
        console.print(f"wrote {path}")
    if interrupted:
        return EXIT_INTERRUPTED
    failed = sum(not r.ok for result in results for r in result.records)
    return 1 if failed or errors else 0
