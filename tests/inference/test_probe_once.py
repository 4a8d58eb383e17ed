"""The hardware probe runs once per process at start: the catalog's fit badges, ``--device auto``,
the Vulkan memory budget and ``bench`` share one probe (``hardware.shared_probe``); it probes
again only when what it depends on changed, or when asked to (the hardware screen's refresh)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app.inference import hardware

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysroots"


@pytest.fixture
def counted(monkeypatch):
    """A fresh shared probe on a real sysroot snapshot (an RX 7900 XTX desktop) with a fixed set of
    TVM runtimes; the probe counter as it stood."""
    monkeypatch.setenv("LLMCHAT_SYSROOT", str(FIXTURES / "amd-rx7900xtx"))
    monkeypatch.setenv("LLMCHAT_TVM_RUNTIMES", "vulkan")
    hardware.forget_shared_probe()
    yield lambda: hardware.PROBE_COUNT
    hardware.forget_shared_probe()


def test_a_start_probes_once(counted):
    from app.commands.models import memory_budget_bytes
    from app.inference.engine.tvm_engine import _vulkan_memory_budget
    from app.inference.hardware.device_spec import resolve_device
    from app.inference.services import LocalServices

    before = counted()
    services = LocalServices()
    report = services.probe()  # the catalog's fit badges
    assert report.gpu is not None and report.gpu.name and report.memory_budget_bytes > 0
    assert memory_budget_bytes() == report.memory_budget_bytes  # `llmchat models`
    resolve_device("auto")  # --device auto (here: the CPU, TVM has no Vulkan device on this machine)
    assert _vulkan_memory_budget() == report.memory_budget_bytes  # the KV cache's budget on Vulkan
    assert services.probe() is report
    assert counted() - before == 1


def test_threads_asking_together_share_one_probe(counted):
    before = counted()
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(hardware.shared_probe())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reports) == 4 and all(r is reports[0] for r in reports)
    assert counted() - before == 1


def test_it_probes_again_when_its_inputs_change_or_when_asked(counted, monkeypatch):
    before = counted()
    first = hardware.shared_probe()
    assert first.backend == "vulkan"
    monkeypatch.setenv("LLMCHAT_TVM_RUNTIMES", "cpu")  # another runtime set: another answer
    second = hardware.shared_probe()
    assert second.backend == "cpu" and counted() - before == 2
    assert hardware.shared_probe() is second and counted() - before == 2
    hardware.forget_shared_probe()  # the hardware screen's refresh
    third = hardware.shared_probe()
    assert third is not second and counted() - before == 3
    assert hardware.probe() is not third and counted() - before == 4  # probe() never shares


def test_a_runtime_registered_after_the_probe_makes_it_stale():
    """A report made before TVM was imported (from TVM's installed libraries) stays current once
    TVM is imported; one made from a live TVM goes stale when another runtime registers (an
    add-on loaded), and any environment switch changes it."""
    env = ("/", None, None, None, None)
    assert hardware._still_current((env, None), (env, ("cuda",)))
    assert hardware._still_current((env, ("cuda",)), (env, ("cuda",)))
    assert not hardware._still_current((env, ("cuda",)), (env, ("cuda", "vulkan")))
    assert not hardware._still_current((env, None), (("/other", None, None, None, None), None))
    assert not hardware._still_current(None, (env, None))
