"""app.inference.engine.cpu_threads: the size of TVM's CPU thread pool."""

from __future__ import annotations

import os

from app.inference.engine.cpu_threads import configure_cpu_threads, default_cpu_threads


def test_thread_count_respects_user_setting(monkeypatch):
    monkeypatch.setenv("TVM_NUM_THREADS", "3")
    assert configure_cpu_threads() == 3
    monkeypatch.delenv("TVM_NUM_THREADS")
    assert configure_cpu_threads() == default_cpu_threads() >= 1
    assert configure_cpu_threads(5) == 5
    assert os.environ["TVM_NUM_THREADS"] == "5"


def test_a_setting_that_is_no_positive_count_gets_the_default(monkeypatch):
    for value in ("0", "auto", "-2", ""):
        monkeypatch.setenv("TVM_NUM_THREADS", value)
        assert configure_cpu_threads() == default_cpu_threads()
        assert os.environ["TVM_NUM_THREADS"] == str(default_cpu_threads())


def test_hyper_threads_of_one_core_count_once():
    """At most one thread per CPU this process may run on, at least one per core."""
    allowed = len(os.sched_getaffinity(0))
    assert 1 <= default_cpu_threads() <= allowed
