"""MLC tensor cache: round trip, and missing / short / corrupt shards named in the error."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from app.errors import LlmchatError
from app.inference.engine.tvm_engine import load_engine
from app.inference.store.weights import load_numpy, load_weights, read_manifest, write_tensor_cache


def _params():
    rng = np.random.default_rng(0)
    return {
        "a.q_weight": rng.integers(0, 2**32, size=(64, 8), dtype=np.uint32),
        "a.q_scale": rng.standard_normal((64, 2)).astype(np.float16),
        "b.weight": rng.standard_normal((300, 17)).astype(np.float32),
        "norm.weight": np.ones(64, np.float32),
    }


def test_round_trip_is_bit_exact_across_shards(tmp_path):
    params = _params()
    write_tensor_cache(params, tmp_path, shard_bytes=4096)
    manifest = read_manifest(tmp_path)
    assert len(manifest.shards) > 1
    assert all(s["md5sum"] for s in manifest.shards)
    loaded = load_numpy(tmp_path)
    assert list(loaded) == list(params)
    for name, arr in params.items():
        assert loaded[name].dtype == arr.dtype and np.array_equal(loaded[name], arr)


def test_upload_to_device(tmp_path):
    import tvm

    params = _params()
    write_tensor_cache(params, tmp_path)
    specs = [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype)} for n, a in params.items()]
    tensors, nbytes = load_weights(tmp_path, specs, tvm.cpu(0))
    assert nbytes == sum(a.nbytes for a in params.values())
    for spec, t in zip(specs, tensors, strict=True):
        assert np.array_equal(t.numpy(), params[spec["name"]])


def test_older_ndarray_cache_name_and_bf16_encoding(tmp_path):
    """``ndarray-cache.json`` and float32 stored as bf16 ("f32-to-bf16") load too."""
    values = np.array([1.0, -2.5, 3.140625, 0.0], np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    (tmp_path / "params_shard_0.bin").write_bytes(bf16.tobytes())
    (tmp_path / "ndarray-cache.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "records": [
                    {
                        "dataPath": "params_shard_0.bin",
                        "format": "raw-shard",
                        "nbytes": 8,
                        "records": [
                            {
                                "name": "w",
                                "shape": [4],
                                "dtype": "float32",
                                "format": "f32-to-bf16",
                                "nbytes": 8,
                                "byteOffset": 0,
                            }
                        ],
                    }
                ],
            }
        )
    )
    assert np.array_equal(load_numpy(tmp_path)["w"], values)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama", "q4f32_1"), target)
    return target


def test_missing_shard_is_named(model_copy):
    (model_copy / "params_shard_1.bin").unlink()
    with pytest.raises(LlmchatError, match=r"params_shard_1\.bin is missing") as err:
        load_engine(model_copy, device="cpu")
    assert "download" in err.value.fix


def test_short_shard_is_named(model_copy):
    shard = model_copy / "params_shard_0.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(LlmchatError, match=r"params_shard_0\.bin has .* bytes"):
        load_engine(model_copy, device="cpu")


def test_corrupt_shard_is_named(model_copy):
    shard = model_copy / "params_shard_1.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(LlmchatError, match=r"params_shard_1\.bin is corrupt"):
        load_engine(model_copy, device="cpu")


def test_missing_manifest_and_missing_tensor(model_copy):
    manifest = json.loads((model_copy / "tensor-cache.json").read_text())
    manifest["records"][0]["records"].pop(0)
    (model_copy / "tensor-cache.json").write_text(json.dumps(manifest))
    with pytest.raises(LlmchatError, match=r"has no tensor"):
        load_engine(model_copy, device="cpu")
    (model_copy / "tensor-cache.json").unlink()
    with pytest.raises(LlmchatError, match=r"tensor-cache\.json is missing"):
        load_engine(model_copy, device="cpu")


def test_weights_of_another_quantization_are_rejected(model_copy, tiny_model_dir):
    other = tiny_model_dir("llama", "q0f32")
    for f in model_copy.glob("params_shard_*.bin"):
        f.unlink()
    for f in other.glob("params_shard_*.bin"):
        shutil.copy(f, model_copy / f.name)
    shutil.copy(other / "tensor-cache.json", model_copy / "tensor-cache.json")
    with pytest.raises(LlmchatError, match=r"different model or quantization|has no tensor"):
        load_engine(model_copy, device="cpu")


def test_missing_config_file(model_copy):
    (model_copy / "mlc-chat-config.json").unlink()
    with pytest.raises(LlmchatError, match=r"mlc-chat-config\.json is missing"):
        load_engine(model_copy, device="cpu")


def test_reads_what_tvms_own_writer_wrote(tmp_path):
    """MLC writes its weights with tvm.contrib.tvmjs.dump_tensor_cache: ours reads that format,
    including float32 stored as bf16 (its default encoding)."""
    from tvm.contrib import tvmjs

    params = _params()
    tvmjs.dump_tensor_cache(params, str(tmp_path / "raw"), encode_format="raw", show_progress=False)
    loaded = load_numpy(tmp_path / "raw")
    for name, arr in params.items():
        assert np.array_equal(loaded[name], arr)
    tvmjs.dump_tensor_cache(params, str(tmp_path / "bf16"), show_progress=False)
    loaded = load_numpy(tmp_path / "bf16")
    w = params["b.weight"]
    assert np.allclose(loaded["b.weight"], w, rtol=1e-2, atol=1e-2)
    assert np.array_equal(loaded["a.q_weight"], params["a.q_weight"])
