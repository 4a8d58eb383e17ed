"""`llmchat bench`: a prefill pass on a real prompt, a decode pass at a depth; --json's last line."""

from __future__ import annotations

import json

import pytest

from app.cli import main


def test_bench_model_dir_json(tiny_model_dir, tiny_engine, capsys):
    model = tiny_model_dir("llama", "q4f32_1")
    code = main(
        [
            "bench",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--gen",
            "24",
            "--warmup",
            "4",
            "--prompt-tokens",
            "40",
            "--depth",
            "20",
            "--runs",
            "2",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0
    assert result["prompt_tokens"] == 40 and result["depth"] == 20 and result["generated_tokens"] == 24
    assert len(result["prefill_runs"]) == len(result["decode_runs"]) == 2
    assert result["prefill_tok_s"] == max(result["prefill_runs"])
    assert result["weight_bytes"] == tiny_engine.info.weight_bytes
    assert "prefill:" in out and "decode:" in out
    from app.inference.store import bench_store

    assert bench_store.results() == []  # a decode after 20 tokens of context is not chat speed at 0


def test_bench_result_is_kept_for_the_speed_estimates(tiny_model_dir, capsys):
    from app.inference.store import bench_store

    model = tiny_model_dir("llama", "q4f32_1")
    assert (
        main(
            [
                "bench",
                "--model",
                str(model),
                "--device",
                "cpu",
                "--gen",
                "16",
                "--warmup",
                "2",
                "--prompt-tokens",
                "0",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kept = bench_store.results()
    assert len(kept) == 1
    assert kept[0].decode_tok_s == pytest.approx(result["decode_tok_s"])
    assert kept[0].weight_bytes == result["weight_bytes"]


def test_bench_random_weights_with_bandwidth_roofline(capsys):
    code = main(
        [
            "bench",
            "--random-weights",
            "tiny-llama",
            "--quantization",
            "q4f32_1",
            "--device",
            "cpu",
            "--gen",
            "16",
            "--warmup",
            "2",
            "--prompt-tokens",
            "8",
            "--bandwidth",
            "50",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["model"] == "random:tiny-llama" and result["prompt_tokens"] == 8 and result["depth"] == 0
    assert result["roofline_tok_s"] == round(50e9 / result["weight_bytes"], 1)
    # percent of the roofline = measured decode / roofline (tiny weights: a very small percentage)
    expected = 100 * result["decode_tok_s"] / result["roofline_tok_s"]
    assert result["roofline_percent"] == pytest.approx(expected, abs=0.06)
    assert "roofline:" in out


def test_bench_rejects_both_model_and_random(capsys):
    assert main(["bench", "--model", "x", "--random-weights", "tiny-llama", "--device", "cpu"]) == 1
    assert "exclude" in capsys.readouterr().err


def test_bench_without_prefill_pass(tiny_model_dir, capsys):
    model = tiny_model_dir("llama", "q4f32_1")
    code = main(
        [
            "bench",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--gen",
            "8",
            "--warmup",
            "2",
            "--prompt-tokens",
            "0",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["prefill_tok_s"] is None and result["prefill_runs"] == [] and result["decode_tok_s"] > 0
    assert "prefill:" not in out


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--prompt-tokens", "1"], "--prompt-tokens 1"),
        (["--depth", "-3"], "--depth"),
        (["--prompt-tokens", "600", "--context-window", "512"], "--context-window 512"),
    ],
)
def test_bench_refuses_sizes_it_cannot_run(flags, named, capsys):
    assert main(["bench", "--random-weights", "tiny-llama", "--device", "cpu", *flags]) == 1
    err = capsys.readouterr().err
    assert named in err and "fix:" in err


def test_bench_depth_beyond_the_model_window(tiny_model_dir, capsys):
    model = tiny_model_dir("llama", "q4f32_1")
    code = main(["bench", "--model", str(model), "--device", "cpu", "--depth", "100000", "--gen", "8"])
    err = capsys.readouterr().err
    assert code == 1 and "context window holds" in err and "fix:" in err


# --- the roofline's bandwidth: a copy measured on this device, kept per device ---------------------

COPY_BYTES = 32 << 20  # beyond the CPU's caches, quick on a shared machine


@pytest.fixture
def copy_cache(tmp_path, monkeypatch):
    """The copy-bandwidth cache file of this test alone."""
    from app.inference.hardware import copy_bandwidth

    file = tmp_path / "copy_bandwidth.json"
    monkeypatch.setattr(copy_bandwidth, "path", lambda: file)
    return file


def test_copy_bandwidth_is_measured_on_the_cpu(copy_cache):
    import time

    from app.inference.hardware import copy_bandwidth

    before = time.time()
    got = copy_bandwidth.measure(None, COPY_BYTES, repeats=3)
    assert got.copy_bytes == COPY_BYTES and len(got.runs) == 3
    assert got.bytes_per_s == max(got.runs)
    # RAM moves between 100 MB/s (a loaded VM) and 2 TB/s (the fastest servers): bytes per second
    assert 1e8 < got.bytes_per_s < 2e12
    assert before <= got.measured_at <= time.time() and not got.cached
    assert got.device.startswith("cpu: ") and "threads" in got.device
    assert not copy_cache.exists()  # measure() keeps nothing; cached() does


def test_copy_bandwidth_is_kept_per_device_and_reused(copy_cache):
    from app.inference.hardware import copy_bandwidth

    first = copy_bandwidth.cached(None, COPY_BYTES, repeats=2)
    assert not first.cached
    stored = json.loads(copy_cache.read_text())
    assert stored["devices"][first.device]["bytes_per_s"] == first.bytes_per_s
    again = copy_bandwidth.cached(None, COPY_BYTES, repeats=2)
    assert again.cached and again.measured_at == first.measured_at and again.bytes_per_s == first.bytes_per_s
    assert copy_bandwidth.lookup(None) == first
    # another device's figure is kept next to it, not over it
    other = {"bytes_per_s": 4.25e12, "measured_at": 1.7e9, "copy_bytes": 1 << 30, "runs": [4.25e12]}
    stored["devices"]["cuda: NVIDIA H200 (driver 580.159.04)"] = other
    copy_cache.write_text(json.dumps(stored))
    assert copy_bandwidth.cached(None, COPY_BYTES).measured_at == first.measured_at
    assert set(json.loads(copy_cache.read_text())["devices"]) == {
        first.device,
        "cuda: NVIDIA H200 (driver 580.159.04)",
    }


@pytest.mark.parametrize(
    "damage",
    [
        "{ not json",
        "[1, 2, 3]",
        '{"devices": "none"}',
        "entry",  # this device's entry: a negative bandwidth
    ],
)
def test_a_damaged_copy_bandwidth_cache_is_measured_again(copy_cache, damage):
    from app.inference.hardware import copy_bandwidth

    key = copy_bandwidth.device_key(None)
    if damage == "entry":
        bad = {"bytes_per_s": -1, "measured_at": 1.7e9, "copy_bytes": 1 << 20, "runs": []}
        damage = json.dumps({"version": 1, "devices": {key: bad}})
    copy_cache.write_text(damage)
    assert copy_bandwidth.lookup(None) is None
    got = copy_bandwidth.cached(None, COPY_BYTES, repeats=2)
    assert not got.cached and got.bytes_per_s > 0 and got.copy_bytes == COPY_BYTES
    kept = json.loads(copy_cache.read_text())  # rewritten whole and valid
    assert kept["devices"][key]["bytes_per_s"] == got.bytes_per_s
    assert copy_bandwidth.lookup(None) == got


def test_copy_bandwidth_refuses_a_copy_too_small_to_mean_anything():
    from app.errors import LlmchatError
    from app.inference.hardware import copy_bandwidth

    with pytest.raises(LlmchatError) as err:
        copy_bandwidth.measure(None, 1 << 20)
    assert "Cannot measure the copy bandwidth" in err.value.problem and "--bandwidth" in err.value.fix


def test_bandwidth_labels_say_where_the_figure_comes_from():
    from app.commands.bench import Bandwidth, roofline_line

    measured = Bandwidth(4.268e12, "measured", "2026-12-02")
    assert measured.label == "measured copy bandwidth (4,268 GB/s, measured 2026-12-02)"
    assert Bandwidth(4.8e12, "datasheet").label == "datasheet bandwidth (4,800 GB/s, not measured here)"
    assert Bandwidth(5.4e10, "given").label == "given bandwidth (54.0 GB/s, --bandwidth)"
    line = roofline_line(53.3, 1125.6, measured)
    assert line.startswith("roofline: 53.3% of measured copy bandwidth (4,268 GB/s, measured 2026-12-02)")


def test_bench_roofline_uses_the_copy_bandwidth_kept_for_this_device(copy_cache, capsys):
    import time

    from app.inference.hardware import copy_bandwidth

    kept = copy_bandwidth.cached(None, COPY_BYTES, repeats=2)  # measured once, before the bench
    args = ["bench", "--random-weights", "tiny-llama", "--quantization", "q4f32_1", "--device", "cpu"]
    code = main([*args, "--gen", "16", "--warmup", "2", "--prompt-tokens", "8", "--json"])
    captured = capsys.readouterr()
    assert code == 0
    result = json.loads(captured.out.strip().splitlines()[-1])
    today = time.strftime("%Y-%m-%d", time.gmtime(kept.measured_at))
    assert result["bandwidth_bytes_per_s"] == kept.bytes_per_s  # reused, not measured again
    assert result["bandwidth_source"] == "measured" and result["bandwidth_measured_on"] == today
    assert result["roofline_tok_s"] == round(kept.bytes_per_s / result["weight_bytes"], 1)
    gb_s = kept.bytes_per_s / 1e9
    shown = f"{gb_s:,.0f}" if gb_s >= 100 else f"{gb_s:.1f}"
    assert f"% of measured copy bandwidth ({shown} GB/s, measured {today})" in captured.out
    assert f"kept from {today}" in captured.err


# --- benchmarks/gpu_decode.py measures through the same code --------------------------------------


def test_gpu_decode_run_and_depth_measure_through_bench_measure(tmp_path, monkeypatch):
    """gpu_decode.py's figures are the ones ``app.commands.bench.measure`` returned: one code path."""
    import os

    import app.commands.bench as bench
    from benchmarks import gpu_decode

    calls = []
    real = bench.measure

    def recording(engine, *args, **kwargs):
        figures = real(engine, *args, **kwargs)
        calls.append((args, figures))
        return figures

    monkeypatch.setattr(bench, "measure", recording)
    cache = os.environ["LLMCHAT_CACHE_DIR"]  # the session's: the tiny library is compiled once
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", cache)  # gpu_decode sets it: restored after the test
    common = [
        "--cache",
        cache,
        "--presets",
        "tiny-llama",
        "--quant",
        "q4f32_1",
        "--plain",
        "",
        "--context",
        "1024",
    ]
    out = tmp_path / "run.json"
    argv = ["run", "--backend", "cpu", *common, "--gen", "12", "--prompt", "8", "--repeats", "2"]
    assert gpu_decode.main([*argv, "--check-steps", "2", "--copy-bw", "0.05", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["presets"]["tiny-llama"]
    assert "error" not in res
    (prompt, depth, gen), figures = calls[-1]
    assert (prompt, depth, gen) == (8, 0, 12)
    assert res["decode_tok_s"] == figures["decode_tok_s"] and res["prefill_tok_s"] == figures["prefill_tok_s"]
    assert res["decode_runs"] == figures["decode_runs"] and len(res["decode_runs"]) == 2
    assert res["roofline_pct"] == round(100 * res["decode_tok_s"] * res["weight_bytes"] / 0.05e12, 1)

    calls.clear()
    out = tmp_path / "depth.json"
    argv = ["depth", "--backend", "cpu", *common, "--prompts", "16", "--depths", "20", "--gen", "6"]
    assert gpu_decode.main([*argv, "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["presets"]["tiny-llama"]
    assert "error" not in res
    by_shape = {args: figures for args, figures in calls}
    assert res["decode_at_depth"]["20"]["tok_s"] == by_shape[(0, 20, 6)]["decode_tok_s"]
    assert res["prefill"]["16"]["tok_s"] == by_shape[(16, 0, 0)]["prefill_tok_s"]
    assert by_shape[(16, 0, 0)]["decode_tok_s"] is None  # a prefill-only pass decodes nothing


#: what the GPU machine's Python does without: gpu_decode.py's run and copy-bw must not need it
GPU_MACHINE_RUN = """
import runpy, sys
BLOCKED = {"torch", "textual", "huggingface_hub", "openai", "starlette", "uvicorn", "keyring"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on the GPU machine")
sys.meta_path.insert(0, Block())
sys.argv = ["benchmarks/gpu_decode.py", *sys.argv[1:]]
runpy.run_path("benchmarks/gpu_decode.py", run_name="__main__")
"""


def test_gpu_decode_run_needs_only_tvms_runtime(tmp_path):
    """``run`` and ``copy-bw`` on a TVM without its compiler (TVM_USE_RUNTIME_LIB=1, as the H200's
    runtime-only wheel) and without PyTorch or the UI's packages: the library compiled beforehand, the
    copy bandwidth measured by the product's code."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cache = str(tmp_path / "cache")  # its own: compile writes a manifest.json there
    common = [
        "--cache",
        cache,
        "--presets",
        "tiny-llama",
        "--quant",
        "q4f32_1",
        "--plain",
        "",
        "--context",
        "1024",
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    compiled = subprocess.run(
        [sys.executable, "benchmarks/gpu_decode.py", "compile", "--arch", "cpu", *common],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    out = tmp_path / "run.json"
    gpu_machine = {**env, "TVM_USE_RUNTIME_LIB": "1"}
    run = ["run", "--backend", "cpu", *common, "--gen", "8", "--prompt", "4", "--repeats", "1"]
    ran = subprocess.run(
        [sys.executable, "-c", GPU_MACHINE_RUN, *run, "--check-steps", "2", "--out", str(out)],
        cwd=root,
        env=gpu_machine,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["runtime_only"] is True
    res = result["presets"]["tiny-llama"]
    assert "error" not in res, res.get("error")
    assert res["decode_tok_s"] > 0 and res["prefill_tok_s"] > 0 and res["prompt_tokens"] == 4
    assert result["copy_bw_source"] == "measured (copy_bandwidth)" and result["copy_bw_TBps"] > 0
    assert res["roofline_pct"] is not None
    copied = subprocess.run(
        [sys.executable, "-c", GPU_MACHINE_RUN, "copy-bw", "--device", "cpu"],
        cwd=root,
        env=gpu_machine,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert copied.returncode == 0, copied.stderr[-2000:]
    assert 1e-4 < float(copied.stdout.strip()) < 2  # TB/s of RAM


def test_measure_reports_no_prefill_from_a_one_token_prompt(tiny_engine):
    from app.commands.bench import measure

    with pytest.raises(ValueError):
        measure(tiny_engine, 1, 0, 8, warmup=0)
    figures = measure(tiny_engine, 0, 0, 8, warmup=0)  # decode only: no prefill figure at all
    assert figures["prefill_tok_s"] is None and figures["prefill_runs"] == [] and figures["decode_tok_s"] > 0


def test_roofline_falls_back_to_the_datasheet_only_where_no_copy_can_be_measured(copy_cache, monkeypatch):
    from pathlib import Path

    import app.inference.hardware as hardware
    from app.commands.bench import roofline_bandwidth
    from app.inference.hardware import copy_bandwidth

    sysroot = Path(__file__).resolve().parents[1] / "fixtures" / "sysroots" / "amd-rx7900xtx"
    report = hardware.probe(sysroot=sysroot, tvm_runtimes={"vulkan", "cpu"})  # a real Radeon's sysfs
    assert report.gpu.bandwidth_bytes_per_s  # the datasheet's figure for that card
    monkeypatch.setattr(hardware, "shared_probe", lambda: report)
    said = []
    # no device to copy on (another engine's GPU): the datasheet's figure, labelled so
    got, name = roofline_bandwidth(None, None, report.backend, said.append)
    assert got.source == "datasheet" and got.bytes_per_s == report.gpu.bandwidth_bytes_per_s
    assert name == report.gpu.name and got.label.startswith("datasheet bandwidth (")
    # a copy that cannot be made (a size below what measures memory): said, and no figure is invented
    monkeypatch.setattr(copy_bandwidth, "CPU_COPY_BYTES", 1 << 20)
    got, name = roofline_bandwidth(None, None, "cpu", said.append)
    assert got is None and name is None and not copy_cache.exists()
    assert said and said[-1].startswith("copy bandwidth not measured: Cannot measure the copy bandwidth")
    # given: neither measured nor looked up
    got, _ = roofline_bandwidth(123.0, None, "cpu", said.append)
    assert got.source == "given" and got.bytes_per_s == 123e9


@pytest.mark.parametrize("argv", [["run", "--prompt", "1"], ["depth", "--prompts", "512,1"]])
def test_gpu_decode_refuses_a_one_token_prefill(argv, tmp_path, capsys):
    from benchmarks import gpu_decode

    with pytest.raises(SystemExit) as stop:
        gpu_decode.main([*argv, "--cache", str(tmp_path), "--out", str(tmp_path / "out.json")])
    assert stop.value.code == 2 and "2 tokens or more" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
