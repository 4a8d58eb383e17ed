"""`llmchat import PATH.gguf [--name NAME]` through the real CLI entry point."""

from __future__ import annotations

import json

from app import paths
from app.cli import main
from tests.inference.tiny_gguf import write_tiny_gguf


def test_import_installs_the_model_and_prints_its_path(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "My-Tiny.Q4_0.gguf", "Q4_0")
    assert main(["import", str(path)]) == 0
    out, err = capsys.readouterr()
    model_dir = paths.models_dir() / "my-tiny-q4_0"
    assert out.strip() == str(model_dir)
    assert "[import]" in err and "llmchat --model my-tiny-q4_0" in err
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    assert set(config["tensor_formats"].values()) == {"ggml_q4_0"}


def test_import_with_name_then_same_name_again_fails(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q8_0")
    assert main(["import", str(path), "--name", "mine"]) == 0
    assert (paths.models_dir() / "mine" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["import", str(path), "--name", "mine"]) == 1
    err = capsys.readouterr().err
    assert "already installed" in err and "fix:" in err


def test_import_of_a_broken_file_is_a_clear_error(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q4_1")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:-64])
    assert main(["import", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "not a complete GGUF file" in err and "Traceback" not in err
    assert not (paths.models_dir() / "broken").exists()
    assert main(["import", str(tmp_path / "missing.gguf")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_import_refuses_a_bad_name(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q8_0")
    assert main(["import", str(path), "--name", "../escape"]) == 1
    assert "cannot be a model name" in capsys.readouterr().err
    assert not (paths.models_dir().parent / "escape").exists()
