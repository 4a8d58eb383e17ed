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
