"""`llmchat bench`: MLC's protocol on a tiny model; --json's last line."""

from __future__ import annotations

import json

import pytest

from app.cli import main


def test_bench_model_dir_json(tiny_model_dir, tiny_engine, capsys):
    model = tiny_model_dir("llama", "q4f32_1")
    code = main(["bench", "--model", str(model), "--device", "cpu", "--gen", "24", "--warmup", "4", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0
    assert result["prompt_tokens"] == 1 and result["generated_tokens"] == 24
    assert result["weight_bytes"] == tiny_engine.info.weight_bytes
    assert "prefill:" in out and "decode:" in out


def test_bench_random_weights_with_bandwidth_roofline(capsys):
    code = main(["bench", "--random-weights", "tiny-llama", "--quantization", "q4f32_1", "--device", "cpu",
                 "--gen", "16", "--warmup", "2", "--prompt-tokens", "8", "--bandwidth", "50", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["model"] == "random:tiny-llama" and result["prompt_tokens"] == 8
    assert result["roofline_tok_s"] == round(50e9 / result["weight_bytes"], 1)
    # percent of the roofline = measured decode / roofline (tiny weights: a very small percentage)
    expected = 100 * result["decode_tok_s"] / result["roofline_tok_s"]
    assert result["roofline_percent"] == pytest.approx(expected, abs=0.06)
    assert "roofline:" in out


def test_bench_rejects_both_model_and_random(capsys):
    assert main(["bench", "--model", "x", "--random-weights", "tiny-llama", "--device", "cpu"]) == 1
    assert "exclude" in capsys.readouterr().err
