"""The test suite's own switches (tests/conftest.py): ``LLMCHAT_NO_SKIP=1`` turns every skip into a
failure (CI), and the GPU suite (marker ``gpu``) is deselected, not skipped, unless ``-m gpu``.

Each case runs a real pytest in a child process on a small test file, with tests/conftest.py
loaded as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SAMPLE = """
import pytest

def test_passes():
    assert True

def test_needs_a_tool():
    pytest.skip("the tool is not installed")

@pytest.mark.skipif(True, reason="a condition of this machine")
def test_skipped_by_mark():
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    assert False

@pytest.mark.gpu
def test_on_the_gpu():
    assert True
"""


def _pytest(tmp_path: Path, source: str, *args: str, no_skip: bool) -> subprocess.CompletedProcess[str]:
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if k != "LLMCHAT_NO_SKIP"}
    if no_skip:
        env["LLMCHAT_NO_SKIP"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.conftest",
        "-p",
        "no:cacheprovider",
        "-c",
        os.devnull,
        "--rootdir",
        str(tmp_path),
        "-q",
        "-rA",
        *args,
        str(test_file),
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_skips_are_reported_as_skips_without_the_switch(tmp_path):
    out = _pytest(tmp_path, SAMPLE, no_skip=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 2 skipped, 1 deselected, 1 xfailed" in out.stdout  # the gpu test: deselected


def test_every_skip_fails_the_run_under_the_switch(tmp_path):
    out = _pytest(tmp_path, SAMPLE, no_skip=True)
    assert out.returncode == 1, out.stdout + out.stderr
    # a skip in the test's body fails it, one in its setup (a skipif mark) is an error; an expected
    # failure (xfail) stays what it is
    assert "1 failed, 1 passed, 1 deselected, 1 xfailed, 1 warning, 1 error" in out.stdout
    assert "LLMCHAT_NO_SKIP is set, and this test skipped: the tool is not installed" in out.stdout
    assert "this test skipped: a condition of this machine" in out.stdout
    assert "test_sample.py::test_needs_a_tool" in out.stdout.split("short test summary")[1]


def test_a_module_skipped_at_collection_fails_the_run_under_the_switch(tmp_path):
    source = """
    import pytest

    pytest.skip("no driver here", allow_module_level=True)

    def test_never_collected():
        pass
    """
    out = _pytest(tmp_path, source, no_skip=False)
    assert out.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "1 skipped" in out.stdout
    out = _pytest(tmp_path, source, no_skip=True)
    assert out.returncode == pytest.ExitCode.TESTS_FAILED, out.stdout + out.stderr
    assert "LLMCHAT_NO_SKIP is set: 1 skipped, failing the run" in out.stdout


@pytest.mark.parametrize("no_skip", [False, True])
def test_the_gpu_suite_runs_only_when_selected(tmp_path, no_skip):
    out = _pytest(tmp_path, SAMPLE, "-m", "gpu", no_skip=no_skip)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 4 deselected" in out.stdout
    assert "PASSED " in out.stdout and "test_sample.py::test_on_the_gpu" in out.stdout
