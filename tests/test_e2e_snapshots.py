"""KV snapshots on the real model: saved, restored after a restart, refused for another model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio

from uma_trio.client import RequestFailed, UmaClient
from uma_trio.config import ServerConfig
from uma_trio.engine.llama import LlamaModel
from uma_trio.protocol.errors import ErrorCode
from uma_trio.runtime.snapshots import SUFFIX

from .conftest import running_server
from .test_e2e_prefix_cache import SYSTEM, chat, greedy

pytestmark = pytest.mark.model


async def test_snapshot_restored_after_a_restart_gives_the_same_greedy_output(
    llama_model: LlamaModel, server_config: ServerConfig, tmp_path: Path
) -> None:
    question = chat(("user", "Where are the maps?"))
    with trio.fail_after(180):
        # --deterministic: a restored prefix gives exactly the cold greedy tokens only there.
        async with running_server(
            llama_model, server_config, snapshot_dir=tmp_path, deterministic=True
        ) as first:
            async with UmaClient.connect(first.config.socket_path) as client:
                saved = await client.snapshot(
                    "save", "library", messages=[{"role": "system", "content": SYSTEM}]
                )
                before, before_eos = await greedy(client, question)
        assert saved.op == "save" and saved.snapshots[0].tokens > 300
        assert (tmp_path / f"library{SUFFIX}").is_file()
        assert before_eos.usage.cached_tokens > 300  # the save left the prefix cached too

        async with running_server(
            llama_model, server_config, snapshot_dir=tmp_path, deterministic=True
        ) as second:
            async with UmaClient.connect(second.config.socket_path) as client:
                listed = await client.snapshot("list")
                restored = await client.snapshot("restore", "library")
                after, after_eos = await greedy(client, question)
                cache = (await client.metrics())["prefix_cache"]
    assert [s.name for s in listed.snapshots] == ["library"]
    assert restored.snapshots[0].tokens == saved.snapshots[0].tokens
    # One size for one file, whichever op reports it (restore said its KV bytes only).
    on_disk = (tmp_path / f"library{SUFFIX}").stat().st_size
    assert saved.snapshots[0].bytes == listed.snapshots[0].bytes == restored.snapshots[0].bytes == on_disk
    assert after_eos.usage.cached_tokens > 300 and cache["hits"] == 1  # served from the restored cells
    assert after == before and len(after) > 5


async def test_snapshot_of_another_model_file_is_refused(
    llama_model: LlamaModel, model_path: Path, server_config: ServerConfig, tmp_path: Path
) -> None:
    """Same architecture, one byte of weights changed: llama.cpp would load the cells happily."""
    other_path = tmp_path / "other.gguf"
    shutil.copyfile(model_path, other_path)
    with other_path.open("r+b") as file:
        file.seek(-7, 2)
        byte = file.read(1)
        file.seek(-7, 2)
        file.write(bytes([byte[0] ^ 0x01]))
    other = LlamaModel(other_path)
    snapshots = tmp_path / "snapshots"
    try:
        with trio.fail_after(120):
            async with running_server(llama_model, server_config, snapshot_dir=snapshots) as original:
                async with UmaClient.connect(original.config.socket_path) as client:
                    await client.snapshot("save", "sys", prompt=SYSTEM)
            async with running_server(other, server_config, snapshot_dir=snapshots) as changed:
                async with UmaClient.connect(changed.config.socket_path) as client:
                    with pytest.raises(RequestFailed) as refused:
                        await client.snapshot("restore", "sys")
                    assert (await client.metrics())["prefix_cache"]["sequences"] == 0
    finally:
        other.close()
    assert refused.value.event.code == ErrorCode.SNAPSHOT_MISMATCH
    assert "another model file" in refused.value.event.message and "other.gguf" in refused.value.event.message


async def test_snapshot_errors_are_clear(
    llama_model: LlamaModel, server_config: ServerConfig, tmp_path: Path
) -> None:
    (tmp_path / f"broken{SUFFIX}").write_bytes(b"not a snapshot at all")
    async with running_server(llama_model, server_config, snapshot_dir=tmp_path, kv_type="f16") as srv:
        async with UmaClient.connect(srv.config.socket_path) as client:
            failures: dict[tuple[str, str | None], str] = {}
            for op, name, fields in [
                ("restore", "missing", {}),
                ("restore", "broken", {}),
                ("restore", "../escape", {}),
                ("save", "x", {}),
                ("list", None, {"prompt": "hi"}),
            ]:
                with pytest.raises(RequestFailed) as failed:
                    await client.snapshot(op, name, **fields)
                failures[(op, name)] = failed.value.event.code
            assert (await client.snapshot("list")).snapshots == []  # the broken file is left out
            await client.snapshot("save", "f16", prompt=SYSTEM)
    messages: dict[str, str] = {}
    for name, overrides in [
        ("cache off", {"kv_type": "f16", "prefix_cache_cells": 0}),
        ("q8_0", {"kv_type": "q8_0"}),
        # llama.cpp refuses a state saved under another stream count or V layout: said by name
        # (it was E_SNAPSHOT_003, "another model shape or KV type?").
        ("other max-sessions", {"kv_type": "f16", "max_sessions": server_config.max_sessions + 1}),
        ("flash attention off", {"kv_type": "f16", "flash_attn": "off"}),
    ]:
        async with running_server(llama_model, server_config, snapshot_dir=tmp_path, **overrides) as srv:
            async with UmaClient.connect(srv.config.socket_path) as client:
                with pytest.raises(RequestFailed) as failed:
                    await client.snapshot("restore", "f16")
                failures[("restore f16 into", name)] = failed.value.event.code
                messages[name] = failed.value.event.message
    assert "KV stream" in messages["other max-sessions"] and "V transposed" in messages["flash attention off"]
    assert failures == {
        ("restore", "missing"): ErrorCode.SNAPSHOT_NOT_FOUND,
        ("restore", "broken"): ErrorCode.SNAPSHOT_INVALID,
        ("restore", "../escape"): ErrorCode.SCHEMA,
        ("save", "x"): ErrorCode.SCHEMA,
        ("list", None): ErrorCode.SCHEMA,
        ("restore f16 into", "cache off"): ErrorCode.SNAPSHOT_MISMATCH,
        ("restore f16 into", "q8_0"): ErrorCode.SNAPSHOT_MISMATCH,
        ("restore f16 into", "other max-sessions"): ErrorCode.SNAPSHOT_MISMATCH,
        ("restore f16 into", "flash attention off"): ErrorCode.SNAPSHOT_MISMATCH,
    }


async def test_an_altered_or_truncated_snapshot_is_refused_even_with_its_prefix_cached(
    llama_model: LlamaModel, server_config: ServerConfig, tmp_path: Path
) -> None:
    """llama.cpp loads altered cells without a word (a review flipped 1,000 bytes near the
    end and got other greedy answers), and a truncated copy read as restored while the
    prefix it names was cached: the KV bytes' length and sha256 are checked first."""
    async with running_server(llama_model, server_config, snapshot_dir=tmp_path) as srv:
        async with UmaClient.connect(srv.config.socket_path) as client:
            await client.snapshot("save", "sys", prompt=SYSTEM)  # its prefix stays cached
            saved = (tmp_path / f"sys{SUFFIX}").read_bytes()
            flipped = bytearray(saved)
            flipped[-1100:-100] = bytes(b ^ 0xFF for b in flipped[-1100:-100])
            (tmp_path / f"flip{SUFFIX}").write_bytes(bytes(flipped))
            (tmp_path / f"cut{SUFFIX}").write_bytes(saved[: len(saved) - 4096])
            listed = [s.name for s in (await client.snapshot("list")).snapshots]
            refused = {}
            for name in ("flip", "cut"):
                with pytest.raises(RequestFailed) as failed:
                    await client.snapshot("restore", name)
                refused[name] = (failed.value.event.code, failed.value.event.message)
            assert (await client.snapshot("restore", "sys")).snapshots[0].name == "sys"
    assert listed == ["flip", "sys"]  # a size that is not the saved one is left out
    assert refused["flip"][0] == refused["cut"][0] == ErrorCode.SNAPSHOT_INVALID
    assert "do not match the sha256" in refused["flip"][1]
    assert "truncated or damaged" in refused["cut"][1]
