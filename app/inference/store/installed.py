"""Is an installed model whole, and what repairs it here?

* ``check_model_files(dir)`` parses what a model directory holds the way a load does (config with
  its validation, tokenizer, chat template, tensor-cache manifest, shard sizes) and raises the first
  problem; a download and an import run it on their staging directory, so nothing is declared
  installed that cannot load.
* ``quick_problem(dir)``: a cheap look (no hashing, no tokenizer) for ``llmchat models`` and the
  models screen: every file the download listed (or the manifest names) is there with its size and
  the config parses; the problem in words, or None.
* ``verify(dir)``: everything ``llmchat download`` checks before it calls an installed model whole:
  the above plus every file's recorded hash (sha256 / git blob id from the Hub's listing, md5 from
  ``tensor-cache.json``), remembered per file by ``file_hashes``.
* ``repair_fix(dir)``: the command that repairs that model on this machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app import paths
from app.errors import LlmchatError

#: written by a download into the model directory: repo, commit, and every file's size and hash
DOWNLOAD_MANIFEST = "llmchat-download.json"
#: written by a GGUF import: the file it came from
IMPORT_RECORD = "llmchat-import.json"
CONFIG_FILE = "mlc-chat-config.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def download_record(model_dir: Path) -> dict[str, Any]:
    """The download manifest of an installed model ({} for an imported or hand-made one)."""
    return _read_json(Path(model_dir) / DOWNLOAD_MANIFEST)


def listed_files(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"?, "blob_id"?}}`` from a download manifest (older ones: sizes only)."""
    files = record.get("files")
    if not isinstance(files, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, value in files.items():
        out[str(name)] = dict(value) if isinstance(value, dict) else {"size": value}
    return out


def _model_id(model_dir: Path) -> str | None:
    """The id of a model directory inside the data directory, else None (a directory given by path)."""
    try:
        if Path(model_dir).resolve().parent == paths.models_dir().resolve():
            return Path(model_dir).name
    except OSError:
        return None
    return None


def _in_catalog(model_id: str) -> bool:
    from app.inference.store.catalog import load_catalog

    try:
        return model_id in load_catalog()
    except LlmchatError:
        return False


def repair_fix(model_dir: Path) -> str:
    """The command that repairs the model in ``model_dir`` here."""
    from app.inference.store.default_model import DEFAULT_MODEL_ID

    model_dir = Path(model_dir)
    model_id = _model_id(model_dir)
    if model_id is None:
        return f"replace the damaged files in {model_dir} (or download or import that model again)"
    if model_id == DEFAULT_MODEL_ID or download_record(model_dir).get("repo") or _in_catalog(model_id):
        return f"`llmchat download {model_id}` checks every file and fetches what is missing or damaged"
    source = _read_json(model_dir / IMPORT_RECORD).get("source")
    if source:
        return (
            f"import it again: `llmchat remove {model_id}` then `llmchat import {source} --name {model_id}`"
        )
    return f"`llmchat remove {model_id}`, then download or import it again"


def _shard_problems(model_dir: Path) -> str | None:
    from app.inference.store.weights import read_manifest, verify_shards

    try:
        verify_shards(model_dir, read_manifest(model_dir), check_md5=False)
    except LlmchatError as err:
        return err.problem
    return None


def quick_problem(model_dir: Path) -> str | None:
    """What is visibly wrong with an installed model (missing or wrong-sized files, a config that
    does not parse), or None; cheap enough for every row of ``llmchat models``."""
    from app.inference.store.config import ModelConfig

    model_dir = Path(model_dir)
    for name, info in listed_files(download_record(model_dir)).items():
        path = model_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = info.get("size")
        if isinstance(size, int) and path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} expected"
    try:
        ModelConfig.load(model_dir)
    except LlmchatError as err:
        return err.problem
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer.model").is_file():
        return "tokenizer.json is missing"
    return _shard_problems(model_dir)


def check_model_files(model_dir: Path) -> None:
    """Parse everything a load parses; raise the first problem (the file named)."""
    from app.inference.engine.chat_template import ChatFormatter
    from app.inference.engine.tokenizer import Tokenizer
    from app.inference.store.config import ModelConfig, check_tokenizer_fits

    model_dir = Path(model_dir)
    cfg = ModelConfig.load(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    check_tokenizer_fits(cfg, tokenizer.vocab_size, str(model_dir))
    ChatFormatter.from_model_dir(model_dir, cfg.raw)
    problem = _shard_problems(model_dir)
    if problem:
        raise LlmchatError(problem, repair_fix(model_dir))


def _file_whole(path: Path, info: dict[str, Any], verifier) -> bool:
    """``path`` exists with the recorded size and hash (sha256 of an LFS file, else its git blob id)."""
    size = info.get("size")
    if not path.is_file() or (isinstance(size, int) and path.stat().st_size != size):
        return False
    if info.get("sha256"):
        return verifier.matches(path, "sha256", str(info["sha256"]))
    if info.get("blob_id"):
        return verifier.matches(path, "git-blob", str(info["blob_id"]))
    return True


def hash_problems(model_dir: Path, files: dict[str, dict[str, Any]], verifier) -> list[str]:
    """Names of the listed files that are missing or whose size or recorded hash differs."""
    return [name for name, info in files.items() if not _file_whole(Path(model_dir) / name, info, verifier)]


def verify(model_dir: Path) -> str | None:
    """Everything checked: listed hashes, shard md5 sums, and the files parse. The problem, or None."""
    from app.inference.store.file_hashes import Verifier
    from app.inference.store.weights import read_manifest, verify_shards

    model_dir = Path(model_dir)
    verifier = Verifier()
    try:
        bad = hash_problems(model_dir, listed_files(download_record(model_dir)), verifier)
    finally:
        verifier.save()
    if bad:
        return f"{', '.join(bad[:3])}{' …' if len(bad) > 3 else ''} missing or damaged"
    try:
        check_model_files(model_dir)
        verify_shards(model_dir, read_manifest(model_dir))
    except LlmchatError as err:
        return err.problem
    return None
