"""The coding agents themselves, unmodified: OpenAI's Codex CLI (``codex exec``, the Responses
API; ``codex --oss``, Ollama's API first), Anthropic's Claude Code (``claude -p``, the Messages
API), OpenCode (``opencode run``), Qwen Code (``qwen -p``) and Continue's CLI (``cn -p``) on
chat completions, and Aider (``aider --message``, Ollama's API through LiteLLM) against a real
daemon; beside them, Ollama's own JavaScript client as apps use it.

Each sends what it sends to OpenAI or Anthropic: a ~10k-token prompt, its whole tool set
(Codex: functions, a ``namespace`` of functions, the hosted ``web_search``; Claude Code: two
dozen tools, and a ``system`` message after the user's), ``reasoning`` / ``thinking`` settings
and its own metadata; OpenCode asks for ``max_tokens`` 32,000.  Before this file, each got a
400 on its first request (``codex --oss`` refused the daemon's Ollama version, Aider's
LiteLLM got a 415); Qwen Code, Continue's CLI and the JavaScript client worked as they were.

The model is the default model's vocabulary over two random layers (benches/gpu/gen_model.py),
its embeddings and output rows set so that it answers every prompt with ``Hello`` and ends:
the 10k-token prompts then take a second, and what the CLI prints is known.  Its chat template
is Qwen 2.5's (tests/fixtures): tools in the system prompt, Hermes ``<tool_call>`` calls.
test_agent_tool_loops.py has the agents' tool round trips, on models built the same way.

The CLIs come from npm, Aider from PyPI in a venv of its own (``.ci/run`` installs them into
``~/.cache/uma-trio/agent-clis``, or ``UMA_AGENT_CLIS`` names a ``node_modules/.bin``
holding them); without them the tests are skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .test_fleet import free_port, wait_for

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests" / "fixtures" / "chat_templates" / "qwen2.5-instruct.jinja"
CLIS = Path(os.environ.get("UMA_AGENT_CLIS", Path.home() / ".cache/uma-trio/agent-clis/node_modules/.bin"))
MODEL = "hello"
ASK = "Say hello in one word."
END = "<|im_end|>"  # the vocabulary's end of generation


def agent_cli(name: str) -> Path:
    path = CLIS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {CLIS} (.ci/run installs it from npm)")
    return path


def write_successor_model(vocab: Path, out: Path, name: str, after: dict[str, str], otherwise: str) -> None:
    """A two-layer random model over ``vocab``'s tokenizer whose next token depends on the last
    one alone: ``after[t]`` follows token ``t`` (GGUF token strings), ``otherwise`` follows any
    other.  Each token of ``after`` gets an embedding dimension of its own (1 there, 0 in the
    others used) and every other token 1 in dimension 0; only the successors' output rows read those
    dimensions, 10 each, so the choice wins by a logit margin of ~80 at any temperature (the
    random rest adds up to ~0.1)."""
    gguf = pytest.importorskip("gguf")
    shape = ["--layers", "2", "--embd", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128"]
    command = [sys.executable, str(ROOT / "benches/gpu/gen_model.py"), "--vocab", str(vocab)]
    subprocess.run([*command, "--out", str(out), *shape, "--ctx", "32768", "--name", name], check=True,
                   capture_output=True)  # fmt: skip
    reader = gguf.GGUFReader(out, "r+")
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
    ids = {token: i for i, token in enumerate(tokens)}
    spelled = [*after, *after.values(), otherwise]
    assert all(tokens.count(t) == 1 for t in spelled)  # else the tokenizer may read another id
    tensors = {t.name: t.data for t in reader.tensors}
    embeddings, output = tensors["token_embd.weight"], tensors["output.weight"]  # rows: tokens
    used = len(after) + 1
    assert used <= embeddings.shape[1]
    embeddings[:, :used], output[:, :used] = 0.0, 0.0
    embeddings[:, 0], output[ids[otherwise], 0] = 1.0, 10.0
    for dimension, (token, successor) in enumerate(after.items(), start=1):
        embeddings[ids[token], 0], embeddings[ids[token], dimension] = 0.0, 1.0
        output[ids[successor], dimension] = 10.0


def write_hello_model(vocab: Path, out: Path) -> None:
    """Answers every prompt ``Hello`` and ends."""
    write_successor_model(vocab, out, MODEL, {"Hello": END}, otherwise="Hello")


@contextmanager
def serving(model: Path, template: Path, tmp: Path) -> Iterator[str]:
    """The base URL of ``uma-trio serve`` on ``model``, with room for the agents' prompts."""
    port = free_port()
    command = [
        sys.executable, "-m", "uma_trio", "serve", "--model", str(model), "--chat-template", str(template),
        "--socket", str(tmp / "d.sock"), "--http", f"127.0.0.1:{port}", "--n-ctx", "32768",
        "--max-prompt-tokens", "30000", "--max-sessions", "2", "--threads", "2",
    ]  # fmt: skip
    with (tmp / "daemon.log").open("wb") as log:
        daemon = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(f"http://127.0.0.1:{port}/v1/models", daemon)
            yield f"http://127.0.0.1:{port}"
        finally:
            daemon.terminate()
            daemon.wait(30)


@pytest.fixture(scope="module")
def hello_daemon(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The daemon on the Hello model and Qwen 2.5's template."""
    tmp = tmp_path_factory.mktemp("agents")
    write_hello_model(model_path, tmp / f"{MODEL}.gguf")
    with serving(tmp / f"{MODEL}.gguf", TEMPLATE, tmp) as base:
        yield base


def reused_tokens(base: str) -> float:
    """The prompt tokens the daemon's prefix cache has saved, from its Prometheus text."""
    return counter(base, "uma_prefix_cache_reused_tokens")


def prompt_tokens(base: str) -> float:
    """The prompt tokens the daemon has accepted."""
    return counter(base, "uma_prompt_tokens")


def counter(base: str, family: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families[family].samples if s.name == f"{family}_total")


def run_agent(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, f"{command[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def codex_home(home: Path, base: str, model: str) -> Path:
    """A ``CODEX_HOME`` whose config sends ``model`` to the daemon at ``base`` (Responses API)."""
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "uma"\n\n[model_providers.uma]\n'
        f'name = "uma-trio"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
    )
    return home


def opencode_config(home: Path, base: str, model: str) -> None:
    """OpenCode's config under ``home``: the daemon as an OpenAI-compatible provider."""
    provider = {
        "npm": "@ai-sdk/openai-compatible", "name": "uma-trio",
        "options": {"baseURL": f"{base}/v1"}, "models": {model: {"name": model}},
    }  # fmt: skip
    config = home / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"provider": {"uma": provider}, "model": f"uma/{model}"}))


def continue_config(path: Path, base: str, model: str) -> Path:
    """A Continue CLI config naming the daemon's ``model`` as its chat model."""
    path.write_text(
        f"name: uma\nversion: 1.0.0\nschema: v1\nmodels:\n  - name: {model}\n    provider: openai\n"
        f"    model: {model}\n    apiBase: {base}/v1\n    apiKey: sk-local\n    roles: [chat]\n"
    )
    return path


def qwen_env(home: Path, base: str, model: str) -> dict[str, str]:
    return {
        "HOME": str(home),
        "OPENAI_API_KEY": "sk-local",
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_MODEL": model,
    }


def claude_env(home: Path, base: str) -> dict[str, str]:
    """Claude Code's settings: the daemon as its Anthropic endpoint, no telemetry."""
    return {
        "HOME": str(home), "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-local",
        "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }  # fmt: skip


def test_codex_exec_is_answered_through_the_responses_api(hello_daemon: str, tmp_path: Path) -> None:
    codex = agent_cli("codex")
    home, work = codex_home(tmp_path / "codex-home", hello_daemon, MODEL), tmp_path / "work"
    work.mkdir()
    asked = prompt_tokens(hello_daemon)
    done = run_agent([str(codex), "exec", "--skip-git-repo-check", ASK], {"CODEX_HOME": str(home)}, work)
    assert done.stdout.strip() == "Hello", done.stderr  # the final message, alone on stdout
    # The next turn sends the whole conversation again: the whole first turn's prompt (and its
    # answer) comes from the prefix cache.
    before, turn_one = reused_tokens(hello_daemon), prompt_tokens(hello_daemon) - asked
    resume = [str(codex), "exec", "resume", "--last", "--skip-git-repo-check", "Again."]
    again = run_agent(resume, {"CODEX_HOME": str(home)}, work)
    assert again.stdout.strip() == "Hello", again.stderr
    assert reused_tokens(hello_daemon) - before >= turn_one > 8000


def test_codex_oss_mode_takes_the_daemon_for_ollama(hello_daemon: str, tmp_path: Path) -> None:
    """``codex --oss``: Ollama's version (at least 0.13.4, the Responses API's) and model list,
    then the same Responses requests."""
    codex = agent_cli("codex")
    env = {"CODEX_HOME": str(tmp_path), "CODEX_OSS_BASE_URL": f"{hello_daemon}/v1"}
    command = [
        str(codex),
        "exec",
        "--oss",
        "--local-provider",
        "ollama",
        "-m",
        MODEL,
        "--skip-git-repo-check",
    ]
    done = run_agent([*command, ASK], env, tmp_path)
    assert done.stdout.strip() == "Hello", done.stderr


def test_opencode_run_is_answered_through_chat_completions(hello_daemon: str, tmp_path: Path) -> None:
    opencode = agent_cli("opencode")
    opencode_config(tmp_path, hello_daemon, MODEL)
    done = run_agent([str(opencode), "run", ASK], {"HOME": str(tmp_path)}, tmp_path)
    assert done.stdout.strip() == "Hello", done.stderr


def test_qwen_code_headless_is_answered_through_chat_completions(hello_daemon: str, tmp_path: Path) -> None:
    qwen = agent_cli("qwen")
    done = run_agent([str(qwen), "-p", ASK], qwen_env(tmp_path, hello_daemon, MODEL), tmp_path)
    assert done.stdout.strip() == "Hello", done.stderr


def test_continue_cli_headless_is_answered_through_chat_completions(
    hello_daemon: str, tmp_path: Path
) -> None:
    cn = agent_cli("cn")
    config = continue_config(tmp_path / "config.yaml", hello_daemon, MODEL)
    done = run_agent([str(cn), "-p", ASK, "--config", str(config)], {"HOME": str(tmp_path)}, tmp_path)
    assert done.stdout.strip() == "Hello", done.stderr


OLLAMA_JS = """
import { Ollama } from 'ollama'
const ollama = new Ollama({ host: process.env.HOST })
const ask = { model: process.env.MODEL, messages: [{ role: 'user', content: 'hi' }] }
const whole = await ollama.chat(ask)
let streamed = ''
for await (const part of await ollama.chat({ ...ask, stream: true })) streamed += part.message.content
const generated = await ollama.generate({ model: ask.model, prompt: 'hi' })
const listed = (await ollama.list()).models.map((m) => m.name)
const shown = await ollama.show({ model: ask.model })
const embedded = await ollama.embed({ model: ask.model, input: ['a', 'b'] })
const version = (await ollama.version()).version
console.log(JSON.stringify({ whole: whole.message.content, reason: whole.done_reason, streamed,
  generated: generated.response, listed, template: typeof shown.template,
  vectors: embedded.embeddings.length, version }))
"""


def test_ollama_s_javascript_client(hello_daemon: str, tmp_path: Path) -> None:
    """The official ``ollama`` npm package, as desktop and editor apps use it."""
    package = CLIS.parent / "ollama"
    if not package.exists():
        pytest.skip(f"the ollama npm package is not installed in {CLIS.parent} (.ci/run installs it)")
    (tmp_path / "node_modules").symlink_to(CLIS.parent)  # where the script's import resolves
    script = tmp_path / "client.mjs"
    script.write_text(OLLAMA_JS)
    done = run_agent(["node", str(script)], {"HOST": hello_daemon, "MODEL": MODEL}, tmp_path)
    assert json.loads(done.stdout) == {
        "whole": "Hello", "reason": "stop", "streamed": "Hello", "generated": "Hello", "listed": [MODEL],
        "template": "string", "vectors": 2, "version": "0.13.4",
    }  # fmt: skip


def test_litellm_s_ollama_providers_are_answered(hello_daemon: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """LiteLLM's ``ollama_chat`` and ``ollama`` providers (Aider's, and many apps' way to
    Ollama) POST with no Content-Type: the body is read as JSON, as Ollama reads it (it was a
    415 unsupported_media_type)."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: no fetch from GitHub
    litellm = pytest.importorskip("litellm")
    ask = [{"role": "user", "content": ASK}]
    for provider in ("ollama_chat", "ollama"):
        whole = litellm.completion(model=f"{provider}/{MODEL}", api_base=hello_daemon, messages=ask)
        assert whole.choices[0].message.content == "Hello", provider
    streamed = litellm.completion(
        model=f"ollama_chat/{MODEL}", api_base=hello_daemon, messages=ask, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == "Hello"

    # Its async calls send the body as application/octet-stream: every one was a 415.
    async def asynchronously() -> None:
        for provider in ("ollama_chat", "ollama"):
            named = f"{provider}/{MODEL}"
            answer = await litellm.acompletion(model=named, api_base=hello_daemon, messages=ask)
            assert answer.choices[0].message.content == "Hello", provider
        chunks = await litellm.acompletion(
            model=f"ollama_chat/{MODEL}", api_base=hello_daemon, messages=ask, stream=True
        )
        assert "".join([chunk.choices[0].delta.content or "" async for chunk in chunks]) == "Hello"

    asyncio.run(asynchronously())


def test_aider_over_ollama_s_api(hello_daemon: str, tmp_path: Path) -> None:
    aider = agent_cli("aider")
    env = {"HOME": str(tmp_path), "OLLAMA_API_BASE": hello_daemon, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    flags = ["--yes-always", "--no-git", "--no-show-model-warnings", "--no-check-update", "--no-analytics"]
    done = run_agent([str(aider), "--model", f"ollama_chat/{MODEL}", "--message", ASK, *flags], env, tmp_path)
    assert "Hello" in done.stdout and "Exception" not in done.stdout, done.stdout


def test_claude_code_print_mode_is_answered_through_the_messages_api(
    hello_daemon: str, tmp_path: Path
) -> None:
    """And its next turn (``--continue``: the whole conversation again) reads the first turn's
    whole ~12.5k-token prompt from the prefix cache instead of prefilling it again."""
    claude = agent_cli("claude")
    env = claude_env(tmp_path, hello_daemon)
    asked = prompt_tokens(hello_daemon)
    done = run_agent([str(claude), "-p", ASK, "--model", MODEL], env, tmp_path)
    assert done.stdout.strip() == "Hello", done.stderr
    before, turn_one = reused_tokens(hello_daemon), prompt_tokens(hello_daemon) - asked
    again = run_agent([str(claude), "-p", "Again.", "--continue", "--model", MODEL], env, tmp_path)
    assert again.stdout.strip() == "Hello", again.stderr
    # The whole first turn's prompt (and its answer) came from the prefix cache.
    assert reused_tokens(hello_daemon) - before >= turn_one > 8000
