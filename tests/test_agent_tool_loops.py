"""A whole tool round trip with the coding agents themselves, unmodified: the daemon's answer
is a tool call, the agent runs the tool on this machine and sends its result back, and the
daemon answers that.  Codex CLI (``codex exec``, the Responses API, a Llama 3.1-style JSON
call), OpenCode and Continue's CLI (chat completions, a Hermes ``<tool_call>``) run ``echo
pineapple`` in their shell tools, Claude Code (``claude -p``, the Messages API, Hermes) in
``Bash``, and Qwen Code (chat completions, Hermes) globs for ``pineapple.txt``.

The model (test_agent_clis.py's ``write_successor_model``) picks its next token from the last
one alone, so it writes a fixed text: after any token the call's first token, after each of
the call's tokens the next, after the last the end.  A token may then appear once in the call;
the calls below are spelled so (JSON's free whitespace, ``Bas`` + ``h``: found by a search
over the vocabulary; the Hermes marker takes the vocabulary's only ``_``, which is why Codex's
``exec_command`` goes in Llama 3.1's format).  To answer a tool's result differently, the
test templates end a prompt whose last turn is a tool's result in newlines up to the token
``\\n\\n\\n``, after which the model says ``Done``.  So ``Done`` comes back only if the daemon
rendered a tool's result as the conversation's last turn (that its text is the tool's output is
each API's translation tests' to show: a template never sees contents).  An agent that added a
turn of its own after the tool's result would fail here with no fault of the daemon's.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from .test_agent_clis import (
    END,
    ROOT,
    agent_cli,
    claude_env,
    codex_home,
    continue_config,
    opencode_config,
    qwen_env,
    reused_tokens,
    run_agent,
    serving,
    write_successor_model,
)

pytestmark = pytest.mark.model

TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"
MODEL = "tools"
ASK = "Say what echo pineapple prints."
AFTER_A_TOOL = "ĊĊĊ"  # "\n\n\n" in the vocabulary's byte-level spelling ("Ġ" is a space)
ANSWER = "Done"

# '{"name":"exec_command","parameters": {"cmd":"echo pineapple"} }'
CODEX_CALL = [
    '{"', "name", '":"', "exec", "_", "command", '","', "parameters", '":', 'Ġ{"', "cmd", '"', ':"',
    "echo", "Ġpineapple", '"}', "Ġ}",
]  # fmt: skip
# '<tool_call> {"name":"Bash","arguments":{"command":"echo pineapple"} }' (the parser closes it)
CLAUDE_CALL = [
    "<", "tool", "_", "call", ">", 'Ġ{"', "name", '":"', "Bas", "h", '","', "arguments", '":', '{"',
    "command", '"', ':"', "echo", "Ġpineapple", '"}', "Ġ}",
]  # fmt: skip
# '<tool_call> {"name":"bash","arguments":{"command":"echo pineapple"} }'
OPENCODE_CALL = [
    "<", "tool", "_", "call", ">", 'Ġ{"', "name", '":"', "bash", '","', "arguments", '":', '{"', "command",
    '"', ':"', "echo", "Ġpineapple", '"}', "Ġ}",
]  # fmt: skip
# '<tool_call> {"name":"glob","arguments":{"pattern":"pineapple.txt"} }'
QWEN_CALL = [
    "<", "tool", "_", "call", ">", 'Ġ{"', "name", '":"', "glob", '","', "arguments", '":', '{"', "pattern",
    '"', ':"', "pine", "apple", ".", "txt", '"}', "Ġ}",
]  # fmt: skip


def write_tool_model(vocab: Path, out: Path, call: list[str]) -> None:
    """Writes ``call`` to any prompt, and ``Done`` after a tool's result."""
    assert len(set(call)) == len(call)  # each token's successor is the one after it
    # The prompts' last tokens ("\n", "\n\n" and the mark) are not in it: they start the call.
    assert not {"Ċ", "ĊĊ", AFTER_A_TOOL, ANSWER, END} & set(call)
    after = dict(itertools.pairwise(call)) | {call[-1]: END, AFTER_A_TOOL: ANSWER, ANSWER: END}
    write_successor_model(vocab, out, MODEL, after, otherwise=call[0])


def with_tool_turn_mark(template: Path, generation_prompt: str, more: str, out: Path) -> Path:
    """``template`` whose generation prompt (the statement writing ``generation_prompt``) is
    followed by ``more`` (newlines, escaped for Jinja) where the last turn is a tool's result:
    the prompt then ends in the token ``\\n\\n\\n``.  (On the role alone: the daemon renders
    each message's content as a marker and tokenizes the text apart, so a template never sees
    it.)"""
    source = template.read_text()
    statement = "{{- '" + generation_prompt + "' }}"
    assert source.count(statement) == 1
    at = source.index(statement) + len(statement)
    last = "messages[-1]"  # Llama 3.1's template takes the system and first user turns out of it
    tool = f"messages and {last}.role in ['tool', 'ipython']"
    out.write_text(source[:at] + "{%- if " + tool + " %}{{- '" + more + "' }}{%- endif %}" + source[at:])
    return out


Template = tuple[Path, str, str]  # (file, its generation prompt, the newlines a tool turn adds)
HERMES = (TEMPLATES / "qwen2.5-instruct.jinja", "<|im_start|>assistant\\n", "\\n\\n")
LLAMA3 = (
    TEMPLATES / "llama-3.1-instruct.jinja",
    "<|start_header_id|>assistant<|end_header_id|>\\n\\n",
    "\\n",
)


@contextmanager
def tool_daemon(vocab: Path, tmp: Path, call: list[str], template: Template) -> Iterator[str]:
    """``uma-trio serve`` on a model writing ``call``, with ``template`` marking tool turns."""
    write_tool_model(vocab, tmp / f"{MODEL}.gguf", call)
    marked = with_tool_turn_mark(*template, tmp / "template.jinja")
    with serving(tmp / f"{MODEL}.gguf", marked, tmp) as base:
        yield base


@pytest.fixture
def daemon_writing(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[list[str], Template], str]]:
    """Starts a daemon on a model writing the call given, with that template (stopped after
    the test), and gives its base URL."""
    with ExitStack() as stack:

        def start(call: list[str], template: Template) -> str:
            tmp = tmp_path_factory.mktemp("daemon")
            return stack.enter_context(tool_daemon(model_path, tmp, call, template))

        yield start


def events(stdout: str) -> list[dict[str, Any]]:
    """An agent's JSON-lines output, its other lines (warnings) left out."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def claude_style_turns(stdout: str) -> tuple[list[tuple[str, Any]], list[tuple[str, bool]], str]:
    """From Claude Code's ``stream-json`` (Qwen Code writes the same): the tool uses (name,
    input), the results sent back (text, is_error), each checked to answer its use, and the
    final answer."""
    messages = [e["message"] for e in events(stdout) if e.get("type") in ("assistant", "user")]
    blocks = [b for m in messages for b in m["content"] if isinstance(b, dict)]
    uses = {b["id"]: (b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"}
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert [r["tool_use_id"] for r in results] == list(uses), stdout
    final = next(e for e in events(stdout) if e.get("type") == "result")
    assert final["is_error"] is False, stdout
    return list(uses.values()), [(r["content"], r["is_error"]) for r in results], final["result"]


def test_codex_runs_the_daemon_s_tool_call_and_gets_the_answer_to_its_output(
    daemon_writing: Callable[[list[str], Template], str], tmp_path: Path
) -> None:
    base = daemon_writing(CODEX_CALL, LLAMA3)
    codex = agent_cli("codex")
    home, work = codex_home(tmp_path / "codex-home", base, MODEL), tmp_path / "work"
    work.mkdir()
    reused = reused_tokens(base)
    # No sandbox: Linux's (Landlock, seccomp) may be missing in a container; the command is echo.
    no_sandbox = "--dangerously-bypass-approvals-and-sandbox"
    command = [str(codex), "exec", "--json", "--skip-git-repo-check", no_sandbox]
    done = run_agent([*command, ASK], {"CODEX_HOME": str(home)}, work)
    items = [e["item"] for e in events(done.stdout) if e.get("type") == "item.completed"]
    ran = [i for i in items if isinstance(i, dict) and i.get("type") == "command_execution"]
    assert len(ran) == 1, done.stdout
    assert "echo pineapple" in str(ran[0]["command"]) and ran[0]["exit_code"] == 0
    assert ran[0]["aggregated_output"] == "pineapple\n"
    said = [i["text"] for i in items if isinstance(i, dict) and i.get("type") == "agent_message"]
    assert said == [ANSWER], done.stdout  # the answer to a prompt ending in the tool's output
    assert reused_tokens(base) - reused > 8000  # the second request's prompt, mostly


def test_claude_code_runs_the_daemon_s_tool_use_and_gets_the_answer_to_its_result(
    daemon_writing: Callable[[list[str], Template], str], tmp_path: Path
) -> None:
    base = daemon_writing(CLAUDE_CALL, HERMES)
    claude = agent_cli("claude")
    env = claude_env(tmp_path, base)
    reused = reused_tokens(base)
    flags = ["--output-format", "stream-json", "--verbose", "--allowedTools", "Bash(echo pineapple)"]
    done = run_agent([str(claude), "-p", ASK, "--model", MODEL, *flags], env, tmp_path)
    uses, results, answer = claude_style_turns(done.stdout)
    assert uses == [("Bash", {"command": "echo pineapple"})], done.stdout
    assert results == [("pineapple", False)], done.stdout
    assert answer == ANSWER, done.stdout  # the answer to a prompt ending in the tool's result
    assert reused_tokens(base) - reused > 8000  # the second request's prompt, mostly


def test_opencode_runs_the_daemon_s_tool_call_and_gets_the_answer_to_its_output(
    daemon_writing: Callable[[list[str], Template], str], tmp_path: Path
) -> None:
    base = daemon_writing(OPENCODE_CALL, HERMES)
    opencode = agent_cli("opencode")
    opencode_config(tmp_path, base, MODEL)
    reused = reused_tokens(base)
    done = run_agent([str(opencode), "run", "--format", "json", ASK], {"HOME": str(tmp_path)}, tmp_path)
    parts = [e["part"] for e in events(done.stdout) if "part" in e]
    tools = [(p["tool"], p["state"]["input"], p["state"]["status"]) for p in parts if p["type"] == "tool"]
    assert tools == [("bash", {"command": "echo pineapple"}, "completed")], done.stdout
    assert next(p for p in parts if p["type"] == "tool")["state"]["output"] == "pineapple\n"
    assert [p["text"] for p in parts if p["type"] == "text"] == [ANSWER], done.stdout
    assert reused_tokens(base) - reused > 5000  # the second request's prompt, mostly


def test_qwen_code_runs_the_daemon_s_tool_call_and_gets_the_answer_to_its_output(
    daemon_writing: Callable[[list[str], Template], str], tmp_path: Path
) -> None:
    base = daemon_writing(QWEN_CALL, HERMES)
    qwen = agent_cli("qwen")
    (tmp_path / "pineapple.txt").write_text("a fruit\n")
    env = qwen_env(tmp_path, base, MODEL)
    reused = reused_tokens(base)
    done = run_agent([str(qwen), "-p", ASK, "--output-format", "stream-json"], env, tmp_path)
    uses, results, answer = claude_style_turns(done.stdout)
    assert uses == [("glob", {"pattern": "pineapple.txt"})], done.stdout
    assert [(text.startswith("Found 1 matching file"), error) for text, error in results] == [(True, False)]
    assert answer == ANSWER, done.stdout
    assert reused_tokens(base) - reused > 8000  # the second request's prompt, mostly


def test_continue_cli_runs_the_daemon_s_tool_call_and_gets_the_answer_to_its_output(
    daemon_writing: Callable[[list[str], Template], str], tmp_path: Path
) -> None:
    base = daemon_writing(CLAUDE_CALL, HERMES)
    cn = agent_cli("cn")
    config = continue_config(tmp_path / "config.yaml", base, MODEL)
    reused = reused_tokens(base)
    command = [str(cn), "-p", ASK, "--config", str(config), "--auto"]  # --auto: Bash runs unasked
    done = run_agent(command, {"HOME": str(tmp_path)}, tmp_path)
    assert done.stdout.strip() == ANSWER, done.stderr
    # What happened in between, from the session Continue keeps.
    sessions = (tmp_path / ".continue" / "sessions").glob("*.json")
    kept = [f for f in sessions if f.name != "sessions.json"]
    assert len(kept) == 1, done.stdout
    history = json.loads(kept[0].read_text())["history"]
    states = [s for h in history for s in h.get("toolCallStates") or []]
    ran = [(s["toolCall"]["function"]["name"], s["parsedArgs"], s["status"]) for s in states]
    assert ran == [("Bash", {"command": "echo pineapple"}, "done")], history
    assert [o["content"] for o in states[0]["output"]] == ["pineapple\n"]
    assert reused_tokens(base) - reused > 1500  # its ~2k-token first prompt, reused
