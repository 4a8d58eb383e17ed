"""`llmchat download` and `llmchat remove` against the loopback hub (tests/hub_server.py)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.cli import main
from app.commands.download import ProgressBar
from app.inference.api import ProgressEvent
from app.inference.store.catalog import installed_model_path, list_installed, staging_path
from tests.hub_server import TINY_ID, TINY_REPO, HubServer, make_tiny_mlc_model, use_hub


@pytest.fixture
def hub(tmp_path, monkeypatch):
    server = HubServer().start()
    server.add_repo(TINY_REPO, make_tiny_mlc_model())
    server.env = use_hub(server, tmp_path, monkeypatch)
    yield server
    server.stop()


def test_download_prints_the_path_and_progress_on_stderr(hub, capsys):
    assert main(["download", TINY_ID]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(installed_model_path(TINY_ID))
    assert "%" in err and "installed" in err
    assert list_installed() == [TINY_ID]


def test_download_accepts_hf_reference(hub, capsys):
    hub.add_repo("someone/Other-MLC", make_tiny_mlc_model(seed=3))
    assert main(["download", "HF://someone/Other-MLC"]) == 0
    assert capsys.readouterr().out.strip().endswith("someone--Other-MLC")


def test_download_errors_are_messages_not_tracebacks(hub, capsys):
    hub.faults.file_status["params_shard_1.bin"] = (404, -1)
    assert main(["download", TINY_ID]) == 1
    err = capsys.readouterr().err
    assert "llmchat:" in err and "404" in err and "Traceback" not in err
    assert list_installed() == []
    assert main(["download", "no-such-model"]) == 1
    assert "unknown model" in capsys.readouterr().err


def _sigint_as_in_a_shell() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_state(pid: int) -> str:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as err:
        return str(err)
    keys = ("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")
    return "; ".join(line for line in lines if line.startswith(keys))


def test_ctrl_c_cancels_cleanly_and_the_next_run_resumes(hub, capsys):
    shard = "params_shard_0.bin"
    hub.faults.stall_after[shard] = 40_000
    env = {**os.environ, **hub.env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "download", TINY_ID],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl+C as a terminal delivers it: a child inherits an ignored or blocked SIGINT from the
        # test process (whatever an earlier test's library did to it); a shell resets both
        preexec_fn=_sigint_as_in_a_shell,
    )
    # the process is mid-download (the stand-in hub holds the shard after 40,000 bytes) before the
    # Ctrl+C; a busy machine can take many seconds to import the app, so the wait is long
    deadline = time.monotonic() + 90
    while hub.counters.bytes_sent.get(shard, 0) < 40_000 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    assert hub.counters.bytes_sent.get(shard, 0) == 40_000, "the download did not start in 90 s"
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    try:
        _out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        state = _signal_state(proc.pid)
        proc.kill()
        raise AssertionError(f"no exit 30 s after SIGINT; the child's signal state: {state}") from None
    # it stops at once, not after a network timeout (the stalled shard would wait for ever)
    assert time.monotonic() - start < 10, err
    assert proc.returncode == 130, err
    assert "cancelled" in err and "resume" in err and "Traceback" not in err
    assert list_installed() == []
    assert (staging_path(TINY_ID) / f"{shard}.part").stat().st_size == 40_000
    hub.faults.stall_after.clear()
    hub.release_stall.set()
    hub.counters.reset()
    assert main(["download", TINY_ID]) == 0
    assert hub.counters.bytes_sent == {shard: 300_000 - 40_000}


def test_remove(hub, capsys):
    assert main(["download", TINY_ID]) == 0
    capsys.readouterr()
    assert main(["remove", TINY_ID]) == 0
    assert "removed" in capsys.readouterr().out
    assert list_installed() == [] and installed_model_path(TINY_ID) is None
    assert main(["remove", TINY_ID]) == 1
    assert "not installed" in capsys.readouterr().err
    hub.add_repo("someone/Other-MLC", make_tiny_mlc_model(seed=3))
    assert main(["download", "HF://someone/Other-MLC"]) == 0
    assert main(["remove", "HF://someone/Other-MLC"]) == 0
    assert list_installed() == []


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_one_line_on_a_terminal():
    stream = FakeTerminal()
    bar = ProgressBar(stream, width=10)
    bar(ProgressEvent("download", "x: 50 MB of 100 MB, 10.0 MB/s, ETA 0:05", 50, 100))
    bar(ProgressEvent("download", "x: 100 MB of 100 MB", 100, 100))
    bar.finish()
    text = stream.getvalue()
    assert text.startswith("\r[#####-----]  50.0% x: 50 MB")
    assert "\r[##########] 100.0%" in text and text.endswith("\n")


def test_progress_bar_logs_sparse_lines_when_not_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(stream, log_every_s=60)
    for done in range(0, 101, 10):
        bar(ProgressEvent("download", f"{done}", done, 100))
    lines = stream.getvalue().splitlines()
    assert lines[0] == "0"  # the start message
    assert len(lines) <= 3 and lines[-1].startswith("100.0%")
