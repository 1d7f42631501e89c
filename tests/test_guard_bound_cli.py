"""benches/guard_bound.py's inputs from a compare.py run: the scenario's prompts, each due
against llama-server's completion of that same prompt."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("guard_bound_cli", BENCHES / "guard_bound.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def storm_run(root: Path, *, drop: str | None = None) -> Path:
    run = root / "storm" / "run-2"
    run.mkdir(parents=True)
    write_csv(run / "summary.csv", [
        {"target": "uma-trio", "scenario": "storm-alone", "lane": "interactive", "gap_p95_ms": "28.5"},
        {"target": "llama-server", "scenario": "storm-alone", "lane": "interactive", "gap_p95_ms": "27.0"},
    ])  # fmt: skip
    requests = [
        {"target": target, "scenario": scenario, "client": client, "lane": lane,
         "completion_ms": ms, "error_code": ""}
        for target, scenario, client, lane, ms in [
            ("uma-trio", "storm", "bulk-2000", "background", "44000"),
            ("llama-server", "storm-alone", "chat-0", "interactive", "3000"),
            ("llama-server", "storm", "bulk-500", "background", "2100"),
            ("llama-server", "storm", "bulk-2000", "background", "8900"),
            ("llama-server", "storm", "bulk-8000", "background", "70000"),
        ]
        if client != drop
    ]  # fmt: skip
    write_csv(run / "requests.csv", requests)
    return run


def test_a_storm_run_gives_each_prompt_its_own_deadline(tmp_path: Path) -> None:
    module = load()
    trace, alone_p95, prompts = module.compare_inputs(storm_run(tmp_path))
    assert trace.name == "ticks.jsonl" and alone_p95 == pytest.approx(0.0285)
    # benches/scenarios/storm.json: 500, 2,000 and 8,000 tokens at 1, 3 and 5 s.
    assert prompts == [(500, 0.0, 2.1), (2000, 2.0, 8.9), (8000, 4.0, 70.0)]


def test_a_prompt_llama_server_did_not_complete_is_named(tmp_path: Path) -> None:
    module = load()
    with pytest.raises(SystemExit, match="bulk-8000"):
        module.compare_inputs(storm_run(tmp_path, drop="bulk-8000"))
