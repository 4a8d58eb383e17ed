"""#20 item 7: every `fix:` llmchat can give here is something the user can do on this machine:
the flags it names exist, the commands it names exist, it points to no wheel that replaces
apache-tvm (MLC's TVM wheels), and Metal is never "fixed" with ROCm on Linux. The sweep reaches the
device errors, the probe's fixes on every fixture machine, the context-full errors and the compile
error of a missing code generator."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from app import chat_commands
from app.cli import SUBCOMMANDS, build_parser
from app.errors import LlmchatError

SYSROOTS = Path(__file__).resolve().parent / "fixtures" / "sysroots"


def _options() -> set[str]:
    parser = build_parser()
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= set(sub._option_string_actions)
    return found


OPTIONS = _options()
#: programs whose options a fix may name (an install command)
FOREIGN = ("pip", "apt", "apt-get", "amdgpu-install", "pacman", "dnf", "zypper", "brew", "sudo", "make")
SLASH = {spec.name for spec in chat_commands.COMMANDS}


def check_fix(fix: str) -> None:
    """Raise AssertionError naming what in ``fix`` the user could not do here."""
    assert fix and fix.strip(), "an empty fix"
    assert "mlc.ai/wheels" not in fix and "mlc-ai-nightly" not in fix, f"MLC's TVM wheels clash: {fix}"
    for match in re.finditer(r"(?<![\w-])(--[a-z][a-z-]+)", fix):
        clause = re.split(r"[`(;:,]", fix[: match.start()])[-1]
        if any(tool in clause.split() for tool in FOREIGN):  # another program's option
            continue
        assert match[1] in OPTIONS, f"no option {match[1]}: {fix}"
    for word in re.findall(r"`llmchat ([a-z]+)\b", fix):  # a command to type
        assert word in SUBCOMMANDS, f"no command `llmchat {word}`: {fix}"
    for name in re.findall(r"(?<![\w/.~])/([a-z]+)\b(?!/)", fix):
        assert name in SLASH, f"no chat command /{name}: {fix}"


def _device_errors() -> list[tuple[str, LlmchatError]]:
    from app.inference.hardware.device_spec import resolve_device

    errors = []
    # (vulkan and rocm: their add-ons' fixes are swept below, without building the add-ons)
    for device in ("metal", "metal:1", "cuda", "cuda:7", "tpu", "cpu:x"):
        try:
            resolve_device(device)
        except LlmchatError as err:
            errors.append((device, err))
    return errors


def test_device_fixes_are_doable_here():
    errors = _device_errors()
    assert {d for d, _ in errors} >= {"metal", "tpu", "cpu:x"}  # at least those fail on any Linux box
    for device, err in errors:
        check_fix(err.fix)
        if device.startswith("metal") and sys.platform != "darwin":
            assert ("macOS" in err.fix and "--device cpu" in err.fix) or "--device auto" in err.fix


@pytest.mark.parametrize("machine", sorted(p.name for p in SYSROOTS.iterdir() if p.is_dir()))
def test_probe_fixes_on_every_fixture_machine(machine):
    from app.inference.hardware import probe

    for runtimes in ({"cpu"}, {"vulkan", "cpu"}, {"rocm", "vulkan", "cpu"}, {"metal", "cpu"}):
        report = probe(sysroot=SYSROOTS / machine, tvm_runtimes=runtimes)
        for fix in report.fixes:
            check_fix(fix)


def test_the_metal_runtime_fix_is_not_a_wheel():
    from app.inference.hardware.decision import _tvm_fix

    fix = _tvm_fix("metal", SimpleNamespace(tvm=SimpleNamespace(details=["no metal runtime"])))
    check_fix(fix)
    assert "--device cpu" in fix


def test_context_full_fixes(tiny_model_dir):
    """The prompt does not fit: shorten it or /system clear; a larger window only where the model has
    one, with an option the chat app and ask both take."""
    from app.inference.engine.tvm_engine import ContextLengthExceeded, _too_long_fix, load_engine

    at_max = _too_long_fix(5000, 4096, 4096)
    check_fix(at_max)
    assert "--context-window" not in at_max and "/system clear" in at_max
    larger = _too_long_fix(5000, 4096, 32768)
    check_fix(larger)
    assert "`--context-window 8192`" in larger
    for argv in (["--context-window", "8192"], ["ask", "--context-window", "8192", "x"]):
        assert build_parser().parse_args(argv).context_window == 8192
    engine = load_engine(tiny_model_dir("llama", "q4f32_1"), device="cpu", context_window=64)
    try:
        with pytest.raises(ContextLengthExceeded) as err:
            list(engine.chat("The quick brown fox jumps over the lazy dog. " * 6))
        check_fix(err.value.fix)
        assert "--context-window 256" in err.value.fix  # the tiny model's own window is 256
        with pytest.raises(LlmchatError) as full:
            engine.runtime.prefill(list(range(80)))
        check_fix(full.value.fix)
    finally:
        engine.close()


def test_a_missing_code_generator_fix(tiny_model_dir, tmp_path):
    """PyPI's apache-tvm has no Vulkan (SPIR-V) code generator: compiling for it says what to do."""
    import tvm

    from app.inference.compile.build import compile_library
    from app.inference.store.config import ModelConfig

    if tvm.get_global_func("target.build.vulkan", allow_missing=True) is not None:
        pytest.fail("this TVM has a Vulkan code generator: pick a target it lacks for this test")
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    with pytest.raises(LlmchatError, match="no Vulkan") as err:
        compile_library(cfg, tvm.target.Target("vulkan"), tmp_path / "lib.so")
    check_fix(err.value.fix)
    assert not (tmp_path / "lib.so").exists()


def test_the_checker_catches_what_it_should():
    for bad in (
        "pip install --pre -f https://mlc.ai/wheels mlc-ai-nightly-rocm62",
        "start llmchat with --no-such-flag",
        "run `llmchat frobnicate`",
        "type /nonsense",
        " ",
    ):
        with pytest.raises(AssertionError):
            check_fix(bad)
    check_fix(
        "use --device cpu, `llmchat doctor`, /system clear, or fix /dev/kfd access; "
        "`sudo apt install x` (or amdgpu-install --usecase=rocm)"
    )
