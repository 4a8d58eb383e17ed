"""`llmchat models`: catalog with size, fit and installed state; fast with 20 entries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app import paths
from app.cli import main
from app.commands import models as models_command
from app.inference import fit
from app.inference.catalog import load_catalog
from tests.hub_server import TINY_REGISTRY

GB = 1_000_000_000


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    for name in ("DATA", "CACHE", "CONFIG"):
        monkeypatch.setenv(f"LLMCHAT_{name}_DIR", str(tmp_path / name.lower()))
    return tmp_path


def run_json(capsys, *extra: str) -> dict:
    assert main(["models", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_entry_with_size_fit_and_installed_state(capsys):
    installed = paths.models_dir() / "qwen2.5-0.5b-instruct"
    installed.mkdir(parents=True)
    (paths.models_dir() / ".staging" / "llama-2-7b-chat").mkdir(parents=True)  # partial: not installed
    out = run_json(capsys, "--memory", "8")
    rows = {row["id"]: row for row in out["models"]}
    catalog = load_catalog()
    assert set(rows) == {entry.id for entry in catalog.entries}
    assert out["memory_budget_bytes"] == 8 * GB
    for entry in catalog.entries:
        row = rows[entry.id]
        assert row["download_bytes"] == entry.download_bytes
        expected = fit.estimate(entry, 8 * GB)
        assert row["fit"]["verdict"] == expected.verdict
        assert row["fit"]["max_context"] == expected.max_context
    assert rows["qwen2.5-0.5b-instruct"]["installed"] is True
    assert rows["qwen2.5-0.5b-instruct"]["path"] == str(installed)
    assert rows["llama-2-7b-chat"]["installed"] is False


def test_fit_depends_on_the_budget(capsys):
    small = {r["id"]: r["fit"]["verdict"] for r in run_json(capsys, "--memory", "1")["models"]}
    big = {r["id"]: r["fit"]["verdict"] for r in run_json(capsys, "--memory", "64")["models"]}
    assert small["llama-3.1-8b-instruct"] == "does not fit" and big["llama-3.1-8b-instruct"] == "fits"
    assert small["smollm2-135m-instruct"] == "fits"
    long = {r["id"]: r["fit"] for r in run_json(capsys, "--memory", "6", "--context", "100000")["models"]}
    assert long["llama-3.1-8b-instruct"]["context"] == 100000
    assert long["llama-3.1-8b-instruct"]["verdict"] == "does not fit"


def test_installed_models_outside_the_catalog_are_listed(capsys):
    other = paths.models_dir() / "someone--Other-MLC"
    other.mkdir(parents=True)
    (other / "params_shard_0.bin").write_bytes(b"x" * 1234)
    rows = {row["id"]: row for row in run_json(capsys, "--memory", "8")["models"]}
    assert rows["someone--Other-MLC"]["installed"] is True
    assert rows["someone--Other-MLC"]["download_bytes"] == 1234
    assert rows["someone--Other-MLC"]["fit"]["verdict"] == "unknown"


def test_probe_budget_is_used_and_failures_mean_unknown(capsys, monkeypatch):
    from app.inference import hardware

    monkeypatch.setattr(hardware, "probe", lambda: SimpleNamespace(memory_budget_bytes=2 * GB), raising=False)
    assert run_json(capsys)["memory_budget_bytes"] == 2 * GB

    def broken():
        raise RuntimeError("no GPU driver")

    monkeypatch.setattr(hardware, "probe", broken, raising=False)
    out = run_json(capsys)
    assert out["memory_budget_bytes"] is None
    assert {row["fit"]["verdict"] for row in out["models"]} == {"unknown"}

    def slow():
        time.sleep(5)
        return SimpleNamespace(memory_budget_bytes=GB)

    monkeypatch.setattr(hardware, "probe", slow, raising=False)
    start = time.monotonic()
    assert run_json(capsys)["memory_budget_bytes"] is None
    assert time.monotonic() - start < 1.5


def phi_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("phi-3.5-mini-instruct"))


def test_table_output(capsys):
    (paths.models_dir() / "phi-3.5-mini-instruct").mkdir(parents=True)
    assert main(["models", "--memory", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "PARAMS", "SIZE", "CONTEXT", "FIT", "LIBRARY", "INSTALLED"]
    assert "compiles here (~" in phi_line(lines)
    phi = next(line for line in lines if line.startswith("phi-3.5-mini-instruct"))
    assert phi.rstrip().endswith("yes") and "2.2 GB" in phi
    assert "memory budget 4.0 GB" in out


def test_twenty_entries_answer_in_under_a_second(dirs):
    registry = dirs / "config" / "models_registry.toml"
    registry.parent.mkdir(parents=True)
    missing = 20 - len(load_catalog().entries)
    extra = [TINY_REGISTRY.replace('"tiny-mlc"', f'"extra-{i}"') for i in range(missing)]
    registry.write_text("".join(extra))
    assert len(load_catalog().entries) == 20
    env = {**os.environ, "LLMCHAT_CONFIG_DIR": str(registry.parent)}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "app", "models", "--json"], capture_output=True, text=True, env=env, check=True
    )
    elapsed = time.monotonic() - start
    assert len(json.loads(result.stdout)["models"]) == 20
    # the whole process, interpreter start included; the command itself is well under a second
    assert elapsed < 2.0, elapsed
    start = time.monotonic()
    models_command.collect(8 * GB)
    assert time.monotonic() - start < 1.0
