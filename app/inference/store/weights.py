"""MLC-format weights: ``tensor-cache.json`` (or the older ``ndarray-cache.json``) + ``params_shard_*.bin``.

``load_weights(model_dir, params, device)`` checks everything first — the manifest lists every
parameter the compiled model takes with the right shape and dtype, every shard exists with the
listed size, md5 sums match (checked once per shard file and remembered) — and only then
uploads, so a model is never half-loaded; a failure names the file.  ``write_tensor_cache`` writes
the same format (tests, GGUF import).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.errors import LlmchatError
from app.inference.quantization.base import to_words, word_spec

MANIFEST_NAMES = ("tensor-cache.json", "ndarray-cache.json")
_REDOWNLOAD = "download the model again (`llmchat download <id>`), or re-run the import"


@dataclass(frozen=True)
class TensorRecord:
    """Where one parameter lives."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: str  # "raw" or "f32-to-bf16"
    nbytes: int
    offset: int
    shard: str


@dataclass
class Manifest:
    """A parsed tensor cache manifest."""

    path: Path
    records: dict[str, TensorRecord]
    shards: list[dict[str, Any]]  # {"dataPath", "nbytes", "md5sum"?}
    metadata: dict[str, Any]


def _np_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError as err:
        raise LlmchatError(f"Unsupported tensor dtype {dtype!r} in the weights.", _REDOWNLOAD) from err


def find_manifest(model_dir: Path) -> Path:
    """The manifest file in ``model_dir``."""
    for name in MANIFEST_NAMES:
        if (model_dir / name).is_file():
            return model_dir / name
    raise LlmchatError(
        f"{model_dir / MANIFEST_NAMES[0]} is missing: the model directory has no weights.",
        repair_fix(model_dir),
    )


def read_manifest(model_dir: str | Path) -> Manifest:
    """Parse ``tensor-cache.json`` / ``ndarray-cache.json`` in ``model_dir``."""
    model_dir = Path(model_dir)
    path = find_manifest(model_dir)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        records: dict[str, TensorRecord] = {}
        shards = []
        for shard in data["records"]:
            data_path = str(shard["dataPath"])
            shards.append(
                {"dataPath": data_path, "nbytes": int(shard["nbytes"]), "md5sum": shard.get("md5sum")}
            )
            for rec in shard["records"]:
                records[rec["name"]] = TensorRecord(
                    name=rec["name"],
                    shape=tuple(int(x) for x in rec["shape"]),
                    dtype=str(rec["dtype"]),
                    encoding=str(rec.get("format", "raw")),
                    nbytes=int(rec["nbytes"]),
                    offset=int(rec["byteOffset"]),
                    shard=data_path,
                )
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise LlmchatError(
            f"{path} is damaged ({type(err).__name__}: {err}).", repair_fix(model_dir)
        ) from err
    return Manifest(path, records, shards, dict(data.get("metadata") or {}))


# ------------------------------------------------------------------------------------------
# Verification
# ------------------------------------------------------------------------------------------
def repair_fix(model_dir: Path) -> str:
    """The fix for a damaged or incomplete model directory: the command that repairs it here."""
    from app.inference.store.installed import repair_fix as fix

    return fix(Path(model_dir))


def verify_shards(model_dir: str | Path, manifest: Manifest, check_md5: bool = True) -> None:
    """Every shard exists with its listed size and md5 sum; raise naming the first bad file.

    An md5 that passed is remembered while the file's size, mtime, ctime and inode stay the same
    (``file_hashes.Verifier``): a shard rewritten with its mtime restored is hashed again."""
    from app.inference.store.file_hashes import Verifier

    model_dir = Path(model_dir)
    verifier = Verifier() if check_md5 else None
    try:
        for shard in manifest.shards:
            path = model_dir / shard["dataPath"]
            if not path.is_file():
                raise LlmchatError(f"Weight shard {path} is missing.", repair_fix(model_dir))
            size = path.stat().st_size
            if size != shard["nbytes"]:
                raise LlmchatError(
                    f"Weight shard {path} has {size} bytes, {shard['nbytes']} expected (truncated or "
                    "damaged).",
                    repair_fix(model_dir),
                )
            md5 = shard.get("md5sum")
            if verifier is not None and md5 and not verifier.matches(path, "md5", str(md5)):
                raise LlmchatError(
                    f"Weight shard {path} is corrupt (md5 sum mismatch).", repair_fix(model_dir)
                )
    finally:
        if verifier is not None:
            verifier.save()


def check_params(manifest: Manifest, params: Iterable[Mapping[str, Any]]) -> None:
    """The manifest holds every parameter the model takes, with matching shape, dtype and size."""
    shard_sizes = {s["dataPath"]: s["nbytes"] for s in manifest.shards}
    for p in params:
        rec = manifest.records.get(p["name"])
        if rec is None:
            raise LlmchatError(
                f"{manifest.path} has no tensor {p['name']!r} that this model needs (wrong or incomplete "
                "weights).",
                repair_fix(manifest.path.parent),
            )
        if (
            (tuple(p["shape"]) != rec.shape or p["dtype"] != rec.dtype)
            and not _as_words(rec, p)
            and not _widened(rec, p)
        ):
            raise LlmchatError(
                f"{manifest.path}: tensor {rec.name} is {rec.dtype}{list(rec.shape)}, the model expects "
                f"{p['dtype']}{list(p['shape'])} (weights from a different model or quantization).",
                repair_fix(manifest.path.parent),
            )
        stored = _np_dtype("uint16" if rec.encoding == "f32-to-bf16" else rec.dtype).itemsize
        want = stored * int(np.prod(rec.shape, dtype=np.int64))
        if rec.nbytes != want or rec.offset + rec.nbytes > shard_sizes.get(rec.shard, -1):
            raise LlmchatError(
                f"{manifest.path}: tensor {rec.name} has an inconsistent size or offset.",
                repair_fix(manifest.path.parent),
            )


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------
def read_array(model_dir: Path, rec: TensorRecord, shard_cache: dict[str, np.ndarray]) -> np.ndarray:
    """One parameter as a numpy array (memory-mapped shard, decoded when stored as bf16)."""
    if rec.shard not in shard_cache:
        shard_cache[rec.shard] = np.memmap(model_dir / rec.shard, dtype=np.uint8, mode="r")
    raw = shard_cache[rec.shard][rec.offset : rec.offset + rec.nbytes]
    if rec.encoding == "f32-to-bf16" and rec.dtype == "float32":
        u16 = np.frombuffer(raw, dtype=np.uint16)
        return (u16.astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(rec.shape)
    return np.frombuffer(raw, dtype=_np_dtype(rec.dtype)).reshape(rec.shape)


def load_numpy(model_dir: str | Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """All (or the named) parameters as numpy arrays (copies), after the size checks."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    verify_shards(model_dir, manifest, check_md5=False)
    cache: dict[str, np.ndarray] = {}
    wanted = list(names) if names is not None else list(manifest.records)
    return {n: np.array(read_array(model_dir, manifest.records[n], cache)) for n in wanted}


def _as_words(rec: Any, p: Mapping[str, Any]) -> bool:
    """Whether the library takes record ``rec`` as the uint32 words of its narrow integers."""
    spec = word_spec(tuple(rec.shape), rec.dtype)
    return spec is not None and (tuple(p["shape"]), p["dtype"]) == (tuple(spec[0]), spec[1])


def _widened(rec: Any, p: Mapping[str, Any]) -> bool:
    """Whether the library takes float16 record ``rec`` as float32 (WGSL without shader-f16)."""
    return rec.dtype == "float16" and p["dtype"] == "float32" and tuple(p["shape"]) == tuple(rec.shape)


def load_weights(
    model_dir: str | Path,
    params: list[Mapping[str, Any]],
    device: Any,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Any], int]:
    """Verify, then upload ``params`` (the compiled model's list, in order) to ``device``.

    Returns the list of ``tvm.runtime.Tensor`` in the same order and the bytes uploaded."""
    import tvm

    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    check_params(manifest, params)
    verify_shards(model_dir, manifest)
    shard_cache: dict[str, np.ndarray] = {}
    uploaded: list[Any] = []
    total = sum(manifest.records[p["name"]].nbytes for p in params)
    done = 0
    try:
        for p in params:
            rec = manifest.records[p["name"]]
            arr = np.ascontiguousarray(read_array(model_dir, rec, shard_cache))
            if _as_words(rec, p):  # narrow integers stored as uint32 words (WGSL): same bytes
                arr = to_words(arr)
            elif _widened(rec, p):  # float16 weights for a GPU without float16 shaders: exact
                arr = arr.astype(np.float32)
            uploaded.append(tvm.runtime.tensor(arr, device=device))
            done += arr.nbytes
            if progress:
                progress(done, total)
    except LlmchatError:
        uploaded.clear()
        raise
    except Exception as err:
        uploaded.clear()  # drop what was uploaded: never half-loaded
        raise LlmchatError(
            f"Loading the weights from {model_dir} failed: {err}",
            "check free device memory, or use a smaller model",
        ) from err
    finally:
        shard_cache.clear()
    return uploaded, done


# ------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------
def write_tensor_cache(
    params: Mapping[str, np.ndarray],
    out_dir: str | Path,
    shard_bytes: int = 32 << 20,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``params`` (name -> array, in order) as MLC's tensor cache; returns the manifest path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = []
    current: list[tuple[str, np.ndarray]] = []
    size = 0

    def flush() -> None:
        nonlocal current, size
        if not current:
            return
        name = f"params_shard_{len(shards)}.bin"
        records, offset, h = [], 0, hashlib.md5()
        tmp = out_dir / (name + ".tmp")
        with tmp.open("wb") as f:
            for pname, arr in current:
                data = np.ascontiguousarray(arr).tobytes()
                f.write(data)
                h.update(data)
                records.append(
                    {
                        "name": pname,
                        "shape": list(arr.shape),
                        "dtype": str(arr.dtype),
                        "format": "raw",
                        "nbytes": len(data),
                        "byteOffset": offset,
                    }
                )
                offset += len(data)
        os.replace(tmp, out_dir / name)
        shards.append(
            {
                "dataPath": name,
                "format": "raw-shard",
                "nbytes": offset,
                "records": records,
                "md5sum": h.hexdigest(),
            }
        )
        current, size = [], 0

    for pname, arr in params.items():
        arr = np.asarray(arr)
        if size and size + arr.nbytes > shard_bytes:
            flush()
        current.append((pname, arr))
        size += arr.nbytes
    flush()
    total = sum(s["nbytes"] for s in shards)
    meta = {"ParamSize": len(params), "ParamBytes": total, **dict(metadata or {})}
    manifest = out_dir / MANIFEST_NAMES[0]
    tmp = out_dir / (MANIFEST_NAMES[0] + ".tmp")
    tmp.write_text(json.dumps({"metadata": meta, "records": shards}), encoding="utf-8")
    os.replace(tmp, manifest)
    return manifest
