"""The facade the UI and the CLI share (``app.inference.services``): one protocol, the real services,
the ``--endpoint`` ones and the tests' stand-in all keep to it; loading, removing and the remote
rules work through it."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest

from app.errors import LlmchatError
from app.inference.services import LocalServices, RemoteServices, Services
from tests.screens.conftest import StandInServices

PROTOCOL_METHODS = sorted(
    name for name, value in vars(Services).items() if callable(value) and not name.startswith("_")
)


def test_the_protocol_names_what_the_ui_and_the_cli_call():
    assert {
        "probe",
        "load_catalog",
        "list_installed",
        "download_model",
        "load_engine",
        "remove_model",
    } <= set(PROTOCOL_METHODS)
    assert {"default_model_id", "remote_endpoint"} <= set(typing.get_type_hints(Services))


@pytest.mark.parametrize(
    "services",
    [LocalServices(), LocalServices(engine="mlc"), RemoteServices("http://127.0.0.1:9"), StandInServices()],
    ids=["local", "mlc", "remote", "stand-in"],
)
def test_every_implementation_keeps_to_the_protocol(services):
    """Same methods with the same parameters (names, order, defaults) as the protocol: a front end
    can swap one for another, and the tests' stand-in cannot drift from the app's services."""
    assert isinstance(services, Services)
    for name in PROTOCOL_METHODS:
        want = inspect.signature(getattr(Services, name))
        have = inspect.signature(getattr(type(services), name))
        assert list(have.parameters) == list(want.parameters), name
        assert [p.default for p in have.parameters.values()] == [
            p.default for p in want.parameters.values()
        ], name


def test_a_stand_in_replaces_only_what_it_names():
    engine = object()
    services = StandInServices(
        load_engine=lambda model, device, progress: engine, list_installed=lambda: ["x"]
    )
    assert services.load_engine("any", "cpu", None) is engine
    assert services.list_installed() == ["x"]
    assert services.load_catalog().get("smollm2-135m-instruct").id == "smollm2-135m-instruct"  # the real one
    with pytest.raises(TypeError, match="no method 'lod_engine'"):
        StandInServices(lod_engine=lambda *a: None)


def test_remote_services_never_download_or_compile_here():
    services = RemoteServices("http://127.0.0.1:9")
    assert services.remote_endpoint == "http://127.0.0.1:9/v1"
    assert services.default_model_id == ""
    assert services.installed_model_path("qwen2.5-0.5b-instruct") is None
    assert services.install_problem("qwen2.5-0.5b-instruct") is None
    services.check_device("rocm:3")  # the server's business: no error here
    assert services.model_or_default(None) == ""  # the first model the server lists
    with pytest.raises(LlmchatError) as err:
        services.download_model("qwen2.5-0.5b-instruct")
    assert "qwen2.5-0.5b-instruct" in err.value.problem and "127.0.0.1:9/v1" in err.value.problem
    assert err.value.fix


def test_check_device_says_what_is_wrong():
    with pytest.raises(LlmchatError) as err:
        LocalServices().check_device("tpu")
    assert "tpu" in err.value.problem and err.value.fix
    LocalServices().check_device("cpu")
    LocalServices(engine="mlc").check_device("tpu")  # MLC-LLM resolves its own devices


def test_remove_takes_an_id_or_a_hub_reference():
    from app import paths

    for model_id, ref in (("owner--repo", "HF://owner/repo"), ("mine", "mine")):
        model_dir = paths.models_dir() / model_id
        model_dir.mkdir(parents=True)
        (model_dir / "params_shard_0.bin").write_bytes(b"\0" * 5000)
        report = LocalServices().remove_model(ref)
        assert not model_dir.exists()
        assert model_dir in report.removed and report.bytes >= 5000


def test_load_engine_applies_the_context_window_and_the_model_defaults(tiny_model_dir, _session_dirs):
    model_dir: Path = tiny_model_dir("llama", "q4f32_1")
    services = LocalServices(context_window=96)
    engine = services.load_engine(model_dir, "cpu")
    try:
        assert engine.info.context_window == 96
        assert engine.info.model_path == str(model_dir)
        defaults = services.sampling_defaults(engine)
        assert defaults.params.max_tokens > 0 and defaults.describe("temperature")
    finally:
        engine.close()
