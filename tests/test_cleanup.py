"""Temporaries of killed runs: found by PID (dead) or age, removed at start and by `llmchat clean`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from app import paths
from app.cleanup import clean_stale, stale_temporaries

ROOT = Path(__file__).resolve().parent.parent


def _dead_pid() -> int:
    """The pid of a child that was SIGKILLed and reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert proc.wait() == -signal.SIGKILL
    return proc.pid


def _llmchat(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ),
    )


def test_import_killed_with_sigkill_leaves_staging_that_clean_reclaims(tmp_path):
    """A real import SIGKILLed while converting tensors leaves `.NAME.importing-PID`; `llmchat clean`
    removes it and says how much it reclaimed."""
    from tests.inference.tiny_gguf import write_tiny_gguf

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    script = textwrap.dedent(f"""
        import os, signal
        from app.inference.store.gguf_import import import_gguf
        def progress(event):
            if event.message.startswith("converting model.layers.1"):
                os.kill(os.getpid(), signal.SIGKILL)
        import_gguf({str(gguf_path)!r}, "victim", progress)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ), timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (staging,) = paths.models_dir().glob(".victim.importing-*")
    (staging / "params_shard_0.bin").write_bytes(b"\0" * 70_000)  # as a big import's shard would be
    out = _llmchat("clean")
    assert out.returncode == 0, out.stderr
    assert f"removed {staging}" in out.stdout
    assert "reclaiming 68.4 KiB" in out.stdout
    assert not staging.exists()
    again = _llmchat("clean")
    assert "nothing to clean" in again.stdout


def test_a_start_removes_what_dead_processes_left_and_keeps_live_ones(tmp_path):
    dead = _dead_pid()
    models = paths.models_dir()
    libs = paths.cache_dir() / "libs"
    models.mkdir(parents=True)
    libs.mkdir(parents=True, exist_ok=True)
    dead_import = models / f".m.importing-{dead}"
    live_import = models / f".m.importing-{os.getpid()}"
    for d in (dead_import, live_import):
        d.mkdir()
        (d / "params_shard_0.bin").write_bytes(b"\0" * 5000)
    dead_lib = libs / f"llama-q4f32_1-cpu-abc.{dead}.x1y2.so.tmp"
    dead_lib.write_bytes(b"\0" * 100)
    build = paths.cache_dir() / "tmp" / f"build-{dead}"
    build.mkdir(parents=True)
    (build / "lib0.o").write_bytes(b"\0" * 100)
    out = _llmchat("models", "--json")
    assert out.returncode == 0, out.stderr
    assert not dead_import.exists() and not dead_lib.exists() and not build.exists()
    assert live_import.exists()  # a running import is never touched


def test_default_model_scratch_is_removed_by_age_when_no_setup_runs(tmp_path):
    scratch = paths.cache_dir() / "import"
    scratch.mkdir(parents=True, exist_ok=True)
    old, young = scratch / ".gguf-old", scratch / ".gguf-young"
    for d in (old, young):
        d.mkdir()
        (d / "model.gguf").write_bytes(b"\0" * 1000)
    long_ago = time.time() - 2 * 3600
    os.utime(old, (long_ago, long_ago))
    assert old in stale_temporaries() and young not in stale_temporaries()
    report = clean_stale()
    assert old in report.removed and report.bytes >= 1000
    assert not old.exists() and young.exists()


def test_scratch_is_kept_while_a_setup_holds_the_lock(tmp_path):
    """A first-run setup in another process (holding the default-model lock) keeps its GGUF."""
    scratch = paths.cache_dir() / "import"
    scratch.mkdir(parents=True, exist_ok=True)
    old = scratch / ".gguf-busy"
    old.mkdir()
    long_ago = time.time() - 2 * 3600
    os.utime(old, (long_ago, long_ago))
    lock = paths.cache_dir() / "default-model.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import fcntl, sys
            fh = open({str(lock)!r}, "w")
            fcntl.flock(fh, fcntl.LOCK_EX)
            print("locked", flush=True)
            sys.stdin.read()
        """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert old not in stale_temporaries()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert old in stale_temporaries()


def test_remove_reclaims_the_models_temporaries_and_says_how_much(tmp_path):
    """`llmchat remove ID` also removes what interrupted runs left of that model: its import staging
    of a dead process and a half-removed copy (a remove killed mid-way), and says what it reclaimed."""
    from app.cli import main
    from app.inference.store.catalog import remove_model_report

    models = paths.models_dir()
    installed = models / "victim"
    installed.mkdir(parents=True)
    (installed / "params_shard_0.bin").write_bytes(b"\0" * 50_000)
    dead = models / f".victim.importing-{_dead_pid()}"
    dead.mkdir()
    (dead / "params_shard_0.bin").write_bytes(b"\0" * 30_000)
    live = models / f".victim.importing-{os.getpid()}"  # an import running now: kept
    live.mkdir()
    trash = models / ".trash-victim-0123abcd"  # fresh: the start's cleanup waits an hour for it
    trash.mkdir()
    (trash / "params_shard_1.bin").write_bytes(b"\0" * 20_000)
    other = models / ".trash-victim2-0123abcd"  # another model's: kept
    other.mkdir()

    report = remove_model_report("victim")
    assert sorted(report.removed) == sorted([installed, dead, trash])
    assert report.bytes == 100_000
    assert live.exists() and other.exists() and not installed.exists()

    installed.mkdir()
    (installed / "tokenizer.json").write_bytes(b"{}" * 500)
    trash.mkdir()
    (trash / "x").write_bytes(b"\0" * 4000)
    assert main(["remove", "victim"]) == 0


def test_remove_prints_what_it_reclaimed(tmp_path):
    models = paths.models_dir()
    (models / "victim").mkdir(parents=True)
    (models / "victim" / "params_shard_0.bin").write_bytes(b"\0" * 50_000)
    (models / ".trash-victim-0123abcd").mkdir()
    (models / ".trash-victim-0123abcd" / "x").write_bytes(b"\0" * 25_000)
    out = _llmchat("remove", "victim")
    assert out.returncode == 0, out.stderr
    assert f"removed {models / 'victim'}" in out.stdout
    assert f"removed {models / '.trash-victim-0123abcd'}" in out.stdout
    assert "reclaimed 73.2 KiB" in out.stdout
    assert not any(models.iterdir())
