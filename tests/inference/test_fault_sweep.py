"""Sweeps of mutated model configs and GGUF headers: each ends in a clean LlmchatError or a model
whose config passes validation — never a signal, never a traceback.

The config sweep runs through the validation layer in this process; the GGUF sweep imports every
mutated file in one child process (a segfault there shows as a negative return code)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.errors import LlmchatError
from app.inference.store.config import ModelConfig

BAD_VALUES = [0, -2, -1, 1, 3, 2.5, "abc", "64", None, True, [], {}, 1 << 40, float("nan"), float("inf")]


def _mutations(base: dict) -> list[tuple[str, dict]]:
    out = []
    top = ["vocab_size", "context_window_size", "prefill_chunk_size", "eos_token_id", "bos_token_id"]
    for key in top + [f"model_config.{k}" for k in base["model_config"]]:
        for value in BAD_VALUES:
            data = json.loads(json.dumps(base))
            where, _, leaf = key.rpartition(".")
            (data[where] if where else data)[leaf] = value
            out.append((f"{key}={value!r}", data))
    import random

    rng = random.Random(0)
    single = list(out)
    for _ in range(120):  # two fields at once
        (_, first), (label, _) = rng.sample(single, 2)
        data = json.loads(json.dumps(first))
        key, _, text = label.partition("=")
        where, _, leaf = key.rpartition(".")
        (data[where] if where else data)[leaf] = BAD_VALUES[[repr(v) for v in BAD_VALUES].index(text)]
        out.append((f"{key} + {label}", data))
    for stop in ([999999], [-1], ["x"], "7"):
        data = json.loads(json.dumps(base))
        data["conv_template"]["stop_token_ids"] = stop
        out.append((f"stop_token_ids={stop!r}", data))
    return out


def test_mutated_model_configs_end_in_a_clean_error_or_a_sound_config(tiny_model_dir):
    from app.inference.compile.build import parameter_specs

    base = json.loads((tiny_model_dir("llama", "q4f32_1") / "mlc-chat-config.json").read_text())
    cases = _mutations(base)
    assert len(cases) >= 300
    outcomes = {"error": 0, "ok": 0}
    for label, data in cases:
        try:
            cfg = ModelConfig.from_dict(data, source="mutated")
        except LlmchatError as err:
            outcomes["error"] += 1
            assert str(err).startswith("mutated: "), label
            continue
        outcomes["ok"] += 1
        counts = [
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.num_hidden_layers,
            cfg.vocab_size,
            cfg.context_window_size,
            cfg.prefill_chunk_size,
        ]
        assert all(isinstance(n, int) and n > 0 for n in counts), label
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0, label
        assert math.isfinite(cfg.rms_norm_eps) and 0 < cfg.rms_norm_eps < 1, label
        assert all(0 <= i < cfg.vocab_size for i in cfg.eos_token_id), label
        try:
            parameter_specs(cfg)  # the model builds from every config that passes ...
        except LlmchatError:  # ... or says why it cannot (e.g. a width the weight format cannot pack)
            outcomes["error"] += 1
    assert outcomes["error"] > 150 and outcomes["ok"] > 20, outcomes


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_hidden_layers", 0, "model_config.num_hidden_layers"),
        ("num_hidden_layers", -2, "model_config.num_hidden_layers"),
        ("num_attention_heads", 0, "model_config.num_attention_heads"),
        ("hidden_size", -64, "model_config.hidden_size"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("rms_norm_eps", "abc", "model_config.rms_norm_eps"),
    ],
)
def test_invalid_field_is_named(tiny_model_dir, tmp_path, field, value, named):
    model = tmp_path / "m"
    src = tiny_model_dir("llama", "q4f32_1")
    model.mkdir()
    data = json.loads((src / "mlc-chat-config.json").read_text())
    data["model_config"][field] = value
    (model / "mlc-chat-config.json").write_text(json.dumps(data))
    with pytest.raises(LlmchatError, match=named.replace(".", r"\.")):
        ModelConfig.load(model)


def test_eos_token_id_not_a_number_is_named(tiny_model_dir):
    data = json.loads((tiny_model_dir("llama", "q4f32_1") / "mlc-chat-config.json").read_text())
    data["eos_token_id"] = "abc"
    with pytest.raises(LlmchatError, match="eos_token_id 'abc'"):
        ModelConfig.from_dict(data)


_SWEEP = textwrap.dedent("""
    import json, sys, traceback
    from pathlib import Path
    from app.errors import LlmchatError
    from app.inference.store.config import ModelConfig
    from app.inference.store.gguf_import import import_gguf
    results = {}
    for path in sorted(Path(sys.argv[1]).glob("*.gguf")):
        try:
            out = import_gguf(path, name=path.stem)
            ModelConfig.load(out)
            results[path.name] = "ok"
        except LlmchatError as err:
            results[path.name] = "error: " + str(err).splitlines()[0]
        except BaseException:
            results[path.name] = "TRACEBACK " + traceback.format_exc()[-600:]
    print(json.dumps(results))
""")


def _gguf_mutants(base: Path, out: Path) -> int:
    """Copies of ``base`` with one header value rewritten in place (also retyped) or one header byte
    flipped; returns how many."""
    import random

    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(base), "r")
    header_end = int(reader.tensors[0].data_offset)
    scalars = [
        (name, f)
        for name, f in reader.fields.items()
        if not name.startswith("GGUF.")
        and f.types
        and f.types[0] in (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32)
    ]
    raw = base.read_bytes()
    n = 0

    def emit(data: bytes) -> None:
        nonlocal n
        (out / f"m{n:03d}.gguf").write_bytes(data)
        n += 1

    for _name, field in scalars:
        value_at = int(field.offset) + sum(int(p.nbytes) for p in field.parts[: field.data[0]])
        type_at = value_at - 4
        variants = [(None, np.uint32(v)) for v in (0, 1, 3, 7, 65536, 1 << 31, 0xFFFFFFFF)]
        variants += [(gguf.GGUFValueType.INT32, np.int32(v)) for v in (-2, -1)]
        variants += [(gguf.GGUFValueType.FLOAT32, np.float32(v)) for v in (2.5, float("nan"), -1.0, 0.0)]
        for new_type, value in variants:
            data = bytearray(raw)
            if new_type is not None:
                data[type_at : type_at + 4] = np.uint32(int(new_type)).tobytes()
            data[value_at : value_at + 4] = value.tobytes()
            emit(bytes(data))
    rng = random.Random(0)
    for _ in range(60):
        data = bytearray(raw)
        at = rng.randrange(24, header_end)
        data[at] = rng.randrange(256)
        emit(bytes(data))
    return n


@pytest.mark.slow
def test_mutated_gguf_headers_end_in_a_clean_error_or_a_model(tmp_path):
    from tests.inference.tiny_gguf import write_tiny_gguf

    base = write_tiny_gguf(tmp_path / "base.gguf", "Q8_0")
    mutants = tmp_path / "mutants"
    mutants.mkdir()
    count = _gguf_mutants(base, mutants)
    assert count >= 150
    proc = subprocess.run(
        [sys.executable, "-c", _SWEEP, str(mutants)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, f"the import sweep died (rc {proc.returncode}): {proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == count
    bad = {k: v for k, v in results.items() if v.startswith("TRACEBACK")}
    assert not bad, json.dumps(bad, indent=1)[:4000]
    errors = [v for v in results.values() if v.startswith("error")]
    assert len(errors) > 60 and any("block_count" in e for e in errors)
    assert "Traceback" not in proc.stderr
