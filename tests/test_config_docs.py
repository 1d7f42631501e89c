"""Settings are declared once (issue 18): ServerConfig's fields are `uma-trio serve`'s flags,
their UMA_* variables and docs/CONFIG.md's table, and the file agrees with the code."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from uma_trio import cli, config_doc
from uma_trio.config import ServerConfig


def test_config_md_holds_the_table_the_code_writes() -> None:
    """Fails when a flag, a default or a help text changed without `python -m
    uma_trio.config_doc` (or when someone edited the table by hand)."""
    assert config_doc.documented(config_doc.CONFIG_MD.read_text()) == config_doc.render()


def test_every_setting_but_the_hidden_ones_is_a_documented_flag() -> None:
    flags = {flag for flag, _, _ in config_doc.serve_flags()}
    hidden = {"burst_quiet_ms", "burst_max_ms", "stream_buffer"}
    renamed = {"socket_path": "--socket", "allowed_uids": "--allow-uid"}
    for field in dataclasses.fields(ServerConfig):
        if field.name in hidden:
            assert "--" + field.name.replace("_", "-") not in flags
            continue
        flag = renamed.get(field.name, "--" + field.name.removesuffix("_s").replace("_", "-"))
        assert flag in flags, f"{field.name} is not a serve flag"
    assert {"--model", "--log-level"} <= flags and len(flags) > 40


def test_the_table_shows_the_dataclass_defaults() -> None:
    rows = {flag: default for flag, default, _ in config_doc.serve_flags()}
    config = ServerConfig()
    assert rows["--n-ctx"] == str(config.n_ctx) and rows["--max-frame-bytes"] == str(config.max_frame_bytes)
    assert rows["--idle-timeout"] == "300" and rows["--latency-cap"] == "1.2"
    assert rows["--deterministic"] == "off" and rows["--threads"] == "all cores"


def test_flags_and_environment_build_the_config() -> None:
    _, bound, _ = cli.app.parse_args(["serve"])
    assert bound.kwargs.get("config", ServerConfig()) == ServerConfig()
    args = ["serve", "--n-ctx", "1024", "--idle-timeout", "5", "--allowed-hosts", "a.test, b.test",
            "--tensor-split", "3,1", "--socket", "/tmp/x/u.sock", "--kv-type", "q8_0"]  # fmt: skip
    config = cli.app.parse_args(args)[1].kwargs["config"]
    assert (config.n_ctx, config.idle_timeout_s, config.allowed_hosts) == (1024, 5.0, ("a.test", "b.test"))
    assert config.tensor_split == (3.0, 1.0) and str(config.socket_path) == "/tmp/x/u.sock"


def test_environment_variables_follow_the_flag_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UMA_IDLE_TIMEOUT", "7")
    monkeypatch.setenv("UMA_SOCK", "/tmp/seeds/uma.sock")  # the seeds' name for --socket
    monkeypatch.setenv("UMA_CORS_ORIGINS", "http://a.test,http://b.test")
    config = cli.app.parse_args(["serve", "--n-ctx", "512"])[1].kwargs["config"]
    assert config.idle_timeout_s == 7.0 and str(config.socket_path) == "/tmp/seeds/uma.sock"
    assert config.cors_origins == ("http://a.test", "http://b.test") and config.n_ctx == 512


def test_a_bad_value_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--idle-timeout"):
        cli.app.parse_args(["serve", "--idle-timeout", "0"])
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        cli.app.parse_args(["serve", "--tls-cert", "/tmp/c.pem"])


def test_serve_help_shows_each_text_as_config_md_does() -> None:
    """Docs review: `serve --help` read the help as markdown, so `"*" as a wildcard inside one
    (http://localhost:*)` lost both asterisks; and --socket listed UMA_SOCKET twice."""

    env = {**os.environ, "COLUMNS": "400"}
    shown = subprocess.run(
        [sys.executable, "-m", "uma_trio", "serve", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert '"*" as a wildcard inside one (http://localhost:*; a closing ":*"' in shown
    for names in re.findall(r"env var: ([^\]]+)\]", shown):
        listed = [n.strip() for n in names.split(",")]
        assert len(listed) == len(set(listed)), listed


def test_a_flag_named_no_has_no_double_negative() -> None:
    """Docs review: `generate --help` offered `--no-stream --no-no-stream`."""
    shown = subprocess.run(
        [sys.executable, "-m", "uma_trio", "generate", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=True,
    ).stdout
    assert "--no-stream" in shown and "--no-no-" not in shown
    assert cli.app.parse_args(["generate", "--prompt", "hi", "--no-stream"])[1].kwargs["no_stream"] is True
