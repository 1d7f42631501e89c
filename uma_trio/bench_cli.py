"""``uma-trio bench``: run a benchmark suite against targets and print them side by side."""

from __future__ import annotations

from pathlib import Path

import msgspec
import trio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .client import ConnectionLost
from .exception_groups import first_leaf
from .loadgen.bench import expected_tokens, plan, run_bench, side_by_side, summary_rows, write_results
from .loadgen.scenario import Suite, load_suite
from .loadgen.targets import Target, parse_target

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


def run(name: str, target_specs: list[str], *, socket_path: Path, api_key: str | None, out: Path) -> int:
    suite = find_suite(name)
    console = Console()
    if suite.skip is not None:
        console.print(f"{suite.name}: not run: {suite.skip}")
        return 0
    try:
        targets: list[Target] = [
            parse_target(t, socket_path=socket_path, api_key=api_key) for t in target_specs
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
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("tokens", total=total)
        try:
            results = trio.run(lambda: run_bench(suite, targets, on_token=lambda: progress.advance(task)))
        except* (ConnectionLost, OSError, RuntimeError, ValueError) as group:
            raise BenchError(f"cannot run on a target: {first_leaf(group)}") from None
    rows = summary_rows(results)
    header, body = side_by_side(rows)
    table = Table(title=f"{suite.name}: {suite.description}" if suite.description else suite.name)
    for column in header:
        table.add_column(column, justify="left" if column in ("scenario", "lane", "figure") else "right")
    for line in body:
        table.add_row(*line)
    console.print(table)
    for path in write_results(results, out):
        console.print(f"wrote {path}")
    failed = sum(not r.ok for result in results for r in result.records)
    return 1 if failed else 0
