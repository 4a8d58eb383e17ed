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
from app.inference.store import fit
from app.inference.store.catalog import load_catalog
from tests.hub_server import TINY_REGISTRY, make_tiny_mlc_model

GB = 1 << 30  # --memory takes GiB


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    for name in ("DATA", "CACHE", "CONFIG"):
        monkeypatch.setenv(f"LLMCHAT_{name}_DIR", str(tmp_path / name.lower()))
    return tmp_path


def install_whole(path: Path) -> None:
    """A model directory that loads (config, tokenizer, tensor cache and its shards)."""
    for name, data in make_tiny_mlc_model(shard_sizes=(1000,)).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)


def run_json(capsys, *extra: str) -> dict:
    assert main(["models", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_entry_with_size_fit_and_installed_state(capsys):
    installed = paths.models_dir() / "qwen2.5-0.5b-instruct"
    install_whole(installed)
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
    install_whole(other)
    size = sum(p.stat().st_size for p in other.rglob("*") if p.is_file())
    rows = {row["id"]: row for row in run_json(capsys, "--memory", "8")["models"]}
    assert rows["someone--Other-MLC"]["installed"] is True and rows["someone--Other-MLC"]["broken"] is None
    assert rows["someone--Other-MLC"]["download_bytes"] == size
    assert rows["someone--Other-MLC"]["fit"]["verdict"] == "unknown"


def test_probe_budget_is_used_and_failures_mean_unknown(capsys, monkeypatch):
    from app.inference import hardware

    monkeypatch.setattr(
        hardware, "shared_probe", lambda: SimpleNamespace(memory_budget_bytes=2 * GB), raising=False
    )
    assert run_json(capsys)["memory_budget_bytes"] == 2 * GB

    def broken():
        raise RuntimeError("no GPU driver")

    monkeypatch.setattr(hardware, "shared_probe", broken, raising=False)
    out = run_json(capsys)
    assert out["memory_budget_bytes"] is None
    assert {row["fit"]["verdict"] for row in out["models"]} == {"unknown"}

    def slow():
        time.sleep(5)
        return SimpleNamespace(memory_budget_bytes=GB)

    monkeypatch.setattr(hardware, "shared_probe", slow, raising=False)
    start = time.monotonic()
    assert run_json(capsys)["memory_budget_bytes"] is None
    assert time.monotonic() - start < 1.5


def phi_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("phi-3.5-mini-instruct"))


def test_table_output(capsys):
    install_whole(paths.models_dir() / "phi-3.5-mini-instruct")
    (paths.models_dir() / "qwen2.5-0.5b-instruct").mkdir(parents=True)  # an empty directory: broken
    assert main(["models", "--memory", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "PARAMS", "SIZE", "CONTEXT", "FIT", "SPEED", "LIBRARY", "INSTALLED"]
    assert "compiles here (~" in phi_line(lines)
    phi = next(line for line in lines if line.startswith("phi-3.5-mini-instruct"))
    assert phi.rstrip().endswith("yes") and "2.00 GiB" in phi  # one unit everywhere: GiB
    qwen = next(line for line in lines if line.startswith("qwen2.5-0.5b-instruct "))
    assert qwen.rstrip().endswith("broken")
    assert "qwen2.5-0.5b-instruct is broken: " in out and "mlc-chat-config.json is missing" in out
    assert "fix: `llmchat download qwen2.5-0.5b-instruct` checks every file" in out
    assert "memory budget 4.00 GiB" in out


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


def cpu_report(cores_budget: int = 8 * GB) -> SimpleNamespace:
    return SimpleNamespace(backend="cpu", gpu=None, memory_budget_bytes=cores_budget)


def test_speed_estimates_mark_slow_models_and_use_bench_results(capsys, monkeypatch):
    """#20 item 6: an estimated decode speed per model (bandwidth ÷ weight bytes) on this machine,
    SLOW below 5 tok/s; once bench measured a model here, its figure is used and scales the others."""
    from app.inference import hardware
    from app.inference.store import bench_store, speed

    monkeypatch.setattr(hardware, "shared_probe", lambda: cpu_report(), raising=False)
    monkeypatch.setattr(speed, "_cores", lambda: 2)
    rows = {r["id"]: r for r in run_json(capsys)["models"]}
    small, big = rows["smollm2-135m-instruct"], rows["llama-3.1-8b-instruct"]
    assert small["speed"]["source"] == big["speed"]["source"] == "estimate"
    assert small["speed"]["decode_tok_s"] == round(12e9 / small["download_bytes"], 1)
    assert not small["speed"]["slow"] and big["speed"]["slow"] and big["speed"]["decode_tok_s"] < 5
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "SLOW" in next(line for line in table.splitlines() if line.startswith("llama-3.1-8b-instruct"))
    assert "SLOW" not in next(line for line in table.splitlines() if line.startswith("smollm2-135m"))

    # llmchat bench measured the default model here (and a GPU elsewhere, which must not count)
    assert (
        bench_store.record(
            {
                "model": "smollm2-135m-instruct",
                "device": "cpu:0",
                "decode_tok_s": 64.0,
                "weight_bytes": 100_000_000,
            }
        )
        is not None
    )
    bench_store.record(
        {
            "model": "qwen2.5-0.5b-instruct",
            "device": "cuda:0",
            "decode_tok_s": 1600.0,
            "weight_bytes": 300_000_000,
        }
    )
    rows = {r["id"]: r for r in run_json(capsys)["models"]}
    assert rows["smollm2-135m-instruct"]["speed"]["source"] == "measured"
    assert rows["smollm2-135m-instruct"]["speed"]["decode_tok_s"] == 64.0
    qwen = rows["qwen2.5-0.5b-instruct"]  # scaled from the CPU run: 6.4 GB/s ÷ its weights
    assert qwen["speed"]["source"] == "bench"
    assert qwen["speed"]["decode_tok_s"] == round(6.4e9 / qwen["download_bytes"], 1)


def test_a_damaged_bench_file_is_ignored(capsys, monkeypatch):
    from app.inference import hardware
    from app.inference.store import bench_store

    monkeypatch.setattr(hardware, "shared_probe", lambda: cpu_report(), raising=False)
    bench_store.path().parent.mkdir(parents=True, exist_ok=True)
    for damage in (
        "{not json",
        '{"results": [1, {"model": "x", "device": "cpu:0", "decode_tok_s": -1}]}',
        '{"results": {"a": 1}}',
        "[]",
    ):
        bench_store.path().write_text(damage)
        assert bench_store.results() == []
        rows = {r["id"]: r for r in run_json(capsys)["models"]}
        assert rows["smollm2-135m-instruct"]["speed"]["source"] == "estimate"
    # recording over a damaged file starts it again
    assert bench_store.record({"model": "m", "device": "cpu:0", "decode_tok_s": 5, "weight_bytes": 9})
    assert [r.model for r in bench_store.results()] == ["m"]
    assert (
        bench_store.record({"model": "m", "device": "cpu:0", "decode_tok_s": float("nan"), "weight_bytes": 9})
        is None
    )
