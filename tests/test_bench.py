"""The benchmark harness: suites, targets, SSE folding, summary math and file schemas
(no model), then one smoke run of `uma-trio bench` against a real daemon's socket and
its HTTP gateway."""

from __future__ import annotations

import csv
import errno
import json
import math
import re
import signal
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.loadgen import ClientSpec, RequestRecord, Scenario, ScenarioResult, load_suite
from uma_trio.loadgen.bench import (
    SUMMARY_FIELDS,
    expected_tokens,
    failure_tally,
    plan,
    run_bench,
    side_by_side,
    summary_rows,
    write_results,
)
from uma_trio.loadgen.stats import TOKEN_CSV_FIELDS, lane_stats, token_rows
from uma_trio.loadgen.targets import (
    DEFAULT_TIMEOUT_S,
    Connection,
    OpenAITarget,
    UmaTarget,
    apply_chunk,
    completion_body,
    parse_target,
)

from .conftest import running_server

SCENARIOS = Path(__file__).parent.parent / "benches" / "scenarios"


def test_every_shipped_scenario_parses() -> None:
    names = {p.stem for p in SCENARIOS.glob("*.json")}
    assert {"mixed", "storm", "scaling", "agents", "ipc", "smoke", "long_ctx", "each_app_separate"} <= names
    for path in SCENARIOS.glob("*.json"):
        suite = load_suite(path)
        assert bool(suite.runs) != bool(suite.skip), path.name  # runs, or a reason why not


def test_copies_expand_with_stagger_and_alone_variants_come_first() -> None:
    suite = load_suite(SCENARIOS / "mixed.json")
    runs = plan(suite)
    assert [r.name for r in runs] == ["mixed-alone", "mixed"]
    assert all(c.lane == "interactive" for c in runs[0].clients)
    chats = [c for c in runs[1].expanded().clients if c.lane == "interactive"]
    assert [(c.name, c.start_s) for c in chats] == [("chat-0", 0.0), ("chat-1", 0.1), ("chat-2", 0.2)]
    assert expected_tokens(runs[1]) == 3 * 4 * 150 + 32


def test_a_bare_scenario_file_is_a_suite_of_one(tmp_path: Path) -> None:
    path = tmp_path / "one.json"
    path.write_text(
        json.dumps({"name": "one", "clients": [{"name": "a", "prompt_tokens": 2, "max_tokens": 3}]})
    )
    suite = load_suite(path)
    assert suite.name == "one" and [r.name for r in suite.runs] == ["one"] and not suite.alone


@pytest.mark.parametrize(
    "bad",
    [
        {"name": "s", "runs": []},
        {
            "name": "s",
            "runs": [{"name": "a", "clients": [{"name": "c", "prompt_tokens": 1, "max_tokens": 1}]}] * 2,
        },
        {
            "name": "s",
            "runs": [
                {"name": "a", "clients": [{"name": "c", "prompt_tokens": 1, "max_tokens": 1, "copies": 0}]}
            ],
        },
        {
            "name": "s",
            "runs": [
                {
                    "name": "a",
                    "clients": [
                        {"name": "c-0", "prompt_tokens": 1, "max_tokens": 1},
                        {"name": "c", "copies": 2, "prompt_tokens": 1, "max_tokens": 1},
                    ],
                }
            ],
        },
    ],
)
def test_bad_suites_are_refused(bad: object, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises((msgspec.ValidationError, ValueError)):
        load_suite(path)


def test_targets_parse() -> None:
    sock = Path("/tmp/x.sock")
    uma = parse_target("uma", socket_path=sock)
    assert isinstance(uma, UmaTarget) and uma.label == "uma" and uma.socket_path == sock
    peer = parse_target("llama-server=openai:http://127.0.0.1:8081/v1", socket_path=sock, api_key="k")
    assert isinstance(peer, OpenAITarget) and peer.label == "llama-server"
    assert peer.base_url == "http://127.0.0.1:8081" and peer.api_key == "k"
    assert parse_target("uma-http:http://h:1", socket_path=sock).label == "uma-http"
    assert parse_target("openai:http://h:1/?a=b", socket_path=sock).label == "http://h:1/?a=b"  # "=" in a URL
    for bad in ("ollama", "openai:", "openai:ftp://x", "x=uma-https:http://h"):
        with pytest.raises(ValueError, match="target"):
            parse_target(bad, socket_path=sock)


def test_the_timeout_reaches_both_kinds_of_target(capsys: pytest.CaptureFixture[str]) -> None:
    from uma_trio.cli.client_commands import bench

    sock = Path("/tmp/x.sock")
    for text in ("uma", "openai:http://h:1"):
        target = parse_target(text, socket_path=sock, timeout_s=5.0)
        assert isinstance(target, UmaTarget | OpenAITarget) and target.timeout_s == 5.0
        assert parse_target(text, socket_path=sock).timeout_s == DEFAULT_TIMEOUT_S == 600.0
    assert bench("smoke", socket=sock, timeout=0.0) == 2  # `uma-trio bench --timeout 0`
    assert "--timeout" in capsys.readouterr().err


def record(**kw: object) -> RequestRecord:
    return msgspec.convert(
        {"client": "c", "lane": "interactive", "index": 0, "sent": 0.0, **kw}, RequestRecord
    )


def test_sse_chunks_fold_into_a_record() -> None:
    r = record()
    lines = [
        ": keep-alive comment",
        'data: {"choices": [{"text": "He", "finish_reason": null}]}',
        "",
        'data: {"choices": [{"text": "", "finish_reason": null}]}',  # a partial character: still a token
        'data: {"choices": [{"text": "", "finish_reason": "length"}]}',
        'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}',
    ]
    assert not any(apply_chunk(line, r, now) for now, line in enumerate(lines, start=1))
    assert apply_chunk("data: [DONE]", r, 9.0)
    assert r.token_times == [2.0, 4.0] and r.eos_reason == "length" and r.ended == 5.0
    assert (r.prompt_tokens, r.completion_tokens, r.ok) == (5, 2, True)


def test_a_final_chunk_with_text_is_a_token_and_errors_end_the_stream() -> None:
    r = record()
    apply_chunk('data: {"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}', r, 1.0)
    assert r.token_times == [1.0] and r.eos_reason == "stop"
    garbled = record()
    assert apply_chunk("data: {not json", garbled, 3.0) and garbled.error_code == "BAD_SSE"
    failed = record()
    assert apply_chunk(
        'data: {"error": {"message": "m", "type": "server_error", "code": "E_LIMIT_008"}}', failed, 2.0
    )
    assert failed.error_code == "E_LIMIT_008" and not failed.ok


def test_completion_body_is_the_socket_request_in_openai_form() -> None:
    spec = ClientSpec(name="c", prompt_tokens=3, max_tokens=7, lane="background")
    body = completion_body(spec, 0, "m")
    assert body == {"model": "m", "prompt": "hello hello hello", "max_tokens": 7, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


SCENARIO = Scenario(
    name="hand",
    clients=[
        ClientSpec(name="a", prompt_tokens=5, max_tokens=4),
        ClientSpec(name="bg", lane="background", prompt_tokens=50, max_tokens=2),
    ],
)


def result(target: str, name: str, chat_times: list[float], *, with_bg: bool = True) -> ScenarioResult:
    records = [
        record(client="a", sent=10.0, token_times=chat_times, ended=chat_times[-1], eos_reason="length")
    ]
    if with_bg:
        records.append(record(client="bg", lane="background", sent=10.0, token_times=[11.0, 11.5], ended=11.5,
                              eos_reason="length"))  # fmt: skip
    scenario = msgspec.structs.replace(SCENARIO, name=name)
    return ScenarioResult(scenario=scenario, started=10.0, finished=12.0, records=records, target=target)


def test_summary_rows_percentiles_ratios_and_table() -> None:
    results = [
        result("uma", "hand-alone", [10.1, 10.2, 10.3, 10.4], with_bg=False),  # gaps 0.1 0.1 0.1
        result("uma", "hand", [10.1, 10.2, 10.4, 10.8]),  # gaps 0.1 0.2 0.4
        result("peer", "hand-alone", [10.2, 10.4, 10.6, 10.8], with_bg=False),  # gaps 0.2 0.2 0.2
        result("peer", "hand", [10.2, 12.0, 12.1, 12.2]),  # gaps 1.8 0.1 0.1
    ]
    rows = summary_rows(results)
    assert all(set(r) <= set(SUMMARY_FIELDS) for r in rows)
    uma = next(r for r in rows if (r["target"], r["scenario"], r["lane"]) == ("uma", "hand", "interactive"))
    assert uma["gap_p50_ms"] == 200.0 and uma["gap_max_ms"] == 400.0 and uma["ttft_p50_ms"] == 100.0
    assert uma["gap_p95_ms"] == pytest.approx(380.0) and uma["gap_p99_ms"] == pytest.approx(396.0)
    assert uma["gap_p95_vs_alone"] == pytest.approx(3.8) and uma["gap_max_vs_alone_p95"] == pytest.approx(4.0)
    # The clients alone get the same figure against their own p95: the machine's floor for it.
    peer_alone = next(
        r for r in rows if (r["target"], r["scenario"], r["lane"]) == ("peer", "hand-alone", "interactive")
    )
    assert peer_alone["gap_max_vs_alone_p95"] == pytest.approx(1.0) and "gap_p95_vs_alone" not in peer_alone
    every = next(r for r in rows if (r["target"], r["scenario"], r["lane"]) == ("uma", "hand", "all"))
    assert every["tokens"] == 6 and every["tokens_per_s"] == 4.0 and every["completed"] == 2  # 10.0-11.5
    assert lane_stats(results[1], "background").ttft == (1.0,)

    header, body = side_by_side(rows)
    assert header == ["scenario", "lane", "figure", "uma", "peer", "peer / uma"]
    gap_max = next(line for line in body if line[:3] == ["hand", "interactive", "gap max (ms)"])
    assert gap_max[3:] == ["400", "1800", "4.50"]


def test_the_clients_alone_get_their_own_max_over_p95() -> None:
    rows = summary_rows([result("uma", "hand-alone", [10.1, 10.2, 10.3, 10.8], with_bg=False)])  # 0.1 0.1 0.5
    (alone,) = (r for r in rows if r["lane"] == "interactive")
    assert alone["gap_p95_ms"] == pytest.approx(460.0)
    assert alone["gap_max_vs_alone_p95"] == pytest.approx(500.0 / 460.0, abs=1e-3)
    # A scenario with neither an alone run nor "-alone" in its name gets no such figure.
    (plain,) = (r for r in summary_rows([result("uma", "hand", [10.1, 10.2])]) if r["lane"] == "interactive")
    assert "gap_max_vs_alone_p95" not in plain


def test_token_rows_and_written_files(tmp_path: Path) -> None:
    runs = [result("uma", "hand", [10.1, 10.2, 10.4, 10.8])]
    rows = token_rows(runs[0])
    header = ["target", "scenario", "client", "request", "token_idx", "t_ms", "lane"]  # the schema
    assert list(TOKEN_CSV_FIELDS) == header and [list(r) for r in rows] == [header] * 6
    assert [(r["client"], r["token_idx"], r["t_ms"]) for r in rows[:2]] == [("a", 0, 100.0), ("a", 1, 200.0)]
    written = write_results(runs, tmp_path)
    names = {p.name for p in written}
    assert {"tokens.csv", "requests.csv", "summary.csv", "timeline-hand.png", "gap_cdf-hand.png"} <= names
    with (tmp_path / "tokens.csv").open() as f:
        assert next(csv.reader(f)) == list(TOKEN_CSV_FIELDS)
    assert all(p.stat().st_size > 1000 for p in written if p.suffix == ".png")


@pytest.mark.model
async def test_smoke_run_on_the_socket_and_the_gateway(
    llama_model: LlamaModel, server_config: ServerConfig, tmp_path: Path
) -> None:
    """The smoke suite through both kinds of target at once, as `uma-trio bench smoke
    --target uma --target uma-http:URL` runs it."""
    suite = load_suite(SCENARIOS / "smoke.json")
    async with running_server(llama_model, server_config, http="127.0.0.1:0") as server:
        targets = [UmaTarget(server.config.socket_path), OpenAITarget(server.http_url or "", "uma-http")]
        tokens = 0

        def count() -> None:
            nonlocal tokens
            tokens += 1

        with trio.fail_after(120):
            results = await run_bench(suite, targets, on_token=count)
    # Each scenario on every target before the next one: the runs compared are close in time.
    assert [(r.target, r.scenario.name) for r in results] == [
        ("uma", "smoke-alone"), ("uma-http", "smoke-alone"), ("uma", "smoke"), ("uma-http", "smoke"),
    ]  # fmt: skip
    for run in results:
        for rec in run.records:
            assert rec.ok, (run.target, rec)
            spec = run.scenario.client(rec.client)
            assert rec.prompt_tokens == spec.prompt_tokens
            assert rec.completion_tokens == len(rec.token_times) <= spec.max_tokens
    assert tokens == sum(len(rec.token_times) for run in results for rec in run.records)
    # Greedy, same prompts: both paths generate the same number of tokens per request.
    by_path = {t: [len(rec.token_times) for run in results if run.target == t for rec in run.records]
               for t in ("uma", "uma-http")}  # fmt: skip
    assert by_path["uma"] == by_path["uma-http"]
    rows = summary_rows(results)
    assert {(r["target"], r["scenario"], r["lane"]) for r in rows} >= {("uma-http", "smoke", "background")}
    assert all(not math.isnan(r["tokens_per_s"]) for r in rows)
    written = write_results(results, tmp_path)
    assert (tmp_path / "summary.csv") in written


def test_unknown_scenarios_and_targets_are_one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from uma_trio.bench_cli import BenchError, find_suite, run

    monkeypatch.chdir(SCENARIOS.parent.parent)
    assert find_suite("mixed").name == "mixed"
    with pytest.raises(BenchError, match=r"one of .*mixed"):
        find_suite("nope")
    with pytest.raises(BenchError, match="target"):
        run("smoke", ["ollama"], socket_path=Path("/tmp/x.sock"), api_key=None, out=Path("/tmp/unused"))
    with pytest.raises(BenchError, match="same label"):
        run("smoke", ["uma", "uma"], socket_path=Path("/tmp/x.sock"), api_key=None, out=Path("/tmp/unused"))
    # A benchmark that cannot run here says why and runs nothing.
    assert (
        run("long_ctx", ["uma"], socket_path=Path("/tmp/x.sock"), api_key=None, out=Path("/tmp/unused")) == 0
    )
    # A missing daemon: which socket, and what to do about it (it said "[Errno 2] No such file
    # or directory" alone).
    with pytest.raises(
        BenchError, match=r"uma: no daemon listening on /tmp/nothing\.sock .*`uma-trio serve`"
    ):
        run("smoke", ["uma"], socket_path=Path("/tmp/nothing.sock"), api_key=None, out=Path("/tmp/unused"))


def test_an_out_folder_that_cannot_be_made_is_refused_before_the_runs(tmp_path: Path) -> None:
    """It failed with a traceback once every run was done, and the results were lost."""
    from uma_trio.bench_cli import BenchError, run

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(BenchError, match="--out"):  # the socket is never tried: no target error
        run("smoke", ["uma"], socket_path=tmp_path / "nothing.sock", api_key=None, out=a_file)


@pytest.mark.parametrize(
    ("line", "code"),
    [
        ('data: {"error": "Input validation error", "error_type": "validation"}', "validation"),
        ('data: {"error": "overloaded"}', "error"),
    ],
)
def test_other_servers_error_chunks_end_the_stream(line: str, code: str) -> None:
    """An error that is a string (text-generation-inference's) was an AttributeError."""
    r = record()
    assert apply_chunk(line, r, 1.0) and r.error_code == code
    quiet = record()  # "error": null is no error
    assert not apply_chunk('data: {"choices": [], "error": null}', quiet, 1.0) and quiet.error_code is None


async def test_a_shipped_suite_runs_in_the_simulator(autojump_clock: trio.abc.Clock) -> None:
    """The scenario files are the simulator's format too: copies and stagger included."""
    from uma_trio.loadgen.simulate import simulate
    from uma_trio.sched.cost import CostCoefficients

    scenario = load_suite(SCENARIOS / "smoke.json").runs[0]
    result, _ = await simulate(scenario, CostCoefficients())
    assert [r.client for r in result.records] == ["chat-0", "chat-0", "chat-1", "chat-1", "bulk"]
    assert all(r.ok and len(r.token_times) == scenario.client(r.client).max_tokens for r in result.records)


def test_every_shipped_scenario_names_the_limits_it_needs_raised() -> None:
    """storm's 8,000-token prompt is refused under the default --max-prompt-tokens (4096), and
    its description named only --n-ctx."""
    defaults = ServerConfig()
    for path in SCENARIOS.glob("*.json"):
        suite = load_suite(path)
        clients = [c for run in suite.runs for c in run.clients]
        prompt = max((c.prompt_tokens for c in clients), default=0)
        context = max((c.prompt_tokens + c.max_tokens for c in clients), default=0)
        needs = {
            "--max-prompt-tokens": (prompt, defaults.max_prompt_tokens),
            "--n-ctx": (context, defaults.n_ctx),
        }
        for flag, (need, default) in needs.items():
            if need > default:
                said = re.search(rf"{flag} >= ([\d,]+)", suite.description)
                assert said and int(said[1].replace(",", "")) >= need, (path.name, flag, need)


def test_plots_of_scenarios_whose_names_slug_alike_do_not_overwrite_each_other(tmp_path: Path) -> None:
    runs = [result("uma", "a/b", [10.1, 10.2]), result("uma", "a_b", [10.1, 10.3])]
    pngs = sorted(p.name for p in write_results(runs, tmp_path) if p.suffix == ".png")
    assert pngs == ["gap_cdf-a_b-2.png", "gap_cdf-a_b.png", "timeline-a_b-2.png", "timeline-a_b.png"]


def test_a_scenario_without_interactive_gaps_plots_without_a_warning(tmp_path: Path) -> None:
    """matplotlib warned "No artists with labels found to put in legend"."""
    run = result("uma", "hand", [10.1])  # one token: no gap
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_results([run], tmp_path)


def test_failure_tally_names_the_codes() -> None:
    run = result("uma", "hand", [10.1, 10.2])
    run.records += [
        record(client="x", error_code="E_LIMIT_006"),
        record(client="y", error_code="CONNECT_FAILED", error_message="no daemon"),
        record(client="z", error_code="CONNECT_FAILED", error_message="no daemon"),
    ]
    assert failure_tally([run, result("uma", "fine", [10.1])]) == [
        "uma hand: CONNECT_FAILED x2, E_LIMIT_006 x1 (no daemon)"
    ]


# -- `uma-trio bench` when targets fail or Ctrl-C comes ------------------------------------


class FakeTarget:
    """A server in the bench's own process: each request streams its tokens 1 ms apart.
    From its ``refuse_from``-th connection (the warm-up's is the first) it refuses to connect;
    request ``interrupt_at`` (a request id) sends the bench SIGINT, as Ctrl-C does."""

    def __init__(
        self, label: str, *, refuse_from: int | None = None, interrupt_at: str | None = None
    ) -> None:
        self.label, self.refuse_from, self.interrupt_at = label, refuse_from, interrupt_at
        self.connections = 0

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Connection]:
        self.connections += 1
        if self.refuse_from is not None and self.connections >= self.refuse_from:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        yield self

    async def run(
        self, spec: ClientSpec, index: int, rec: RequestRecord, clock: Callable[[], float],
        on_token: Callable[[], None],
    ) -> bool:  # fmt: skip
        if spec.request_id(index) == self.interrupt_at:
            signal.raise_signal(signal.SIGINT)
            await trio.sleep_forever()
        for _ in range(spec.max_tokens):
            await trio.sleep(0.001)
            rec.token_times.append(clock())
            on_token()
        rec.ended, rec.eos_reason = clock(), "length"
        return True


TWO_RUNS = {
    "name": "two",
    "runs": [
        {"name": "first", "clients": [{"name": "a", "prompt_tokens": 4, "max_tokens": 3}]},
        {"name": "second", "clients": [{"name": "b", "prompt_tokens": 4, "max_tokens": 3, "requests": 2},
                                       {"name": "c", "prompt_tokens": 4, "max_tokens": 50}]},
    ],
}  # fmt: skip


def bench_with(
    targets: dict[str, FakeTarget], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, Path]:
    """`uma-trio bench two.json --target NAME ...` on fake targets: the exit status and --out."""
    from uma_trio import bench_cli
    from uma_trio.cli.client_commands import bench

    suite = tmp_path / "two.json"
    suite.write_text(json.dumps(TWO_RUNS))
    monkeypatch.setattr(bench_cli, "parse_target", lambda text, **_: targets[text])
    out = tmp_path / "out"
    return bench(str(suite), target=list(targets), socket=tmp_path / "unused.sock", out=out), out


def csv_rows(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_dead_target_keeps_the_other_targets_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One target that could not be reached aborted the whole bench, and nothing was written."""
    targets = {"live": FakeTarget("live"), "dead": FakeTarget("dead", refuse_from=1)}
    status, out = bench_with(targets, tmp_path, monkeypatch)
    assert status == 1
    assert "error: dead: [Errno 111] Connection refused" in capsys.readouterr().err
    summary = csv_rows(out / "summary.csv")
    assert {(r["target"], r["scenario"]) for r in summary} == {("live", "first"), ("live", "second")}
    assert all(r["failed"] == "0" for r in summary)


def test_each_scenario_runs_on_every_target_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Target after target put a whole suite between the two runs compared side by side, and
    this VM's speed drifts by tens of percent over that; each scenario now runs on every target
    in turn, in the order the targets were named."""
    targets = {"one": FakeTarget("one"), "two": FakeTarget("two")}
    status, out = bench_with(targets, tmp_path, monkeypatch)
    assert status == 0
    order = [(r["target"], r["scenario"]) for r in csv_rows(out / "requests.csv")]
    assert list(dict.fromkeys(order)) == [
        ("one", "first"), ("two", "first"), ("one", "second"), ("two", "second"),
    ]  # fmt: skip


def test_a_target_that_dies_mid_run_is_recorded_and_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From its third connection (the second run's clients) the target refuses: those clients'
    requests are CONNECT_FAILED, the first run's results are kept, and the console says which
    codes failed (the table shows only counts)."""
    status, out = bench_with({"uma": FakeTarget("uma", refuse_from=3)}, tmp_path, monkeypatch)
    assert status == 1
    printed = capsys.readouterr().out
    assert "failed: uma second: CONNECT_FAILED x3 ([Errno 111] Connection refused)" in printed
    requests = csv_rows(out / "requests.csv")
    assert [(r["scenario"], r["client"], r["error_code"]) for r in requests] == [
        ("first", "a", ""), ("second", "b", "CONNECT_FAILED"), ("second", "b", "CONNECT_FAILED"),
        ("second", "c", "CONNECT_FAILED"),
    ]  # fmt: skip


def test_ctrl_c_prints_one_line_writes_what_ran_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed a 35-line BaseExceptionGroup traceback and wrote nothing."""
    # A suite started in the background (`pytest &` from a script) inherits SIGINT ignored,
    # as the shell sets it for background jobs, and the Ctrl-C this test sends was lost.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status, out = bench_with({"uma": FakeTarget("uma", interrupt_at="b-1")}, tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert status == 130
    assert capsys.readouterr().err == "interrupted\n"
    requests = csv_rows(out / "requests.csv")
    assert [(r["scenario"], r["client"], r["index"], r["error_code"]) for r in requests] == [
        ("first", "a", "0", ""), ("second", "b", "0", ""), ("second", "b", "1", "INTERRUPTED"),
        ("second", "c", "0", "INTERRUPTED"),  # in flight then
    ]  # fmt: skip
