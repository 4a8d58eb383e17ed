"""The facade the UI and the CLI share (``app.inference.services``): one protocol, the real services,
the ``--endpoint`` ones and the tests' stand-in all keep to it; loading, removing and the remote
rules work through it."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest

from app.errors import LlmchatError
from app.inference.api import ModelSampling, SamplingParams
from app.inference.services import (
    Bundle,
    LocalServices,
    RemoteServices,
    SamplingRules,
    SavedServers,
    Services,
)
from tests.screens.conftest import SYSROOTS, StandInServices

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
        "hardware_report",  # llmchat doctor
        "build_bundle",  # llmchat build
        "open_server",
        "sampling_defaults",
    } <= set(PROTOCOL_METHODS)
    hints = typing.get_type_hints(Services)
    assert {"default_model_id", "remote_endpoint"} <= set(hints)
    assert hints["servers"] is SavedServers and hints["sampling"] is SamplingRules


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
    # the two parts every implementation carries: the saved servers and the sampling rules
    assert isinstance(services.servers, SavedServers)
    assert isinstance(services.sampling, SamplingRules)


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


def test_the_hardware_report_of_a_sysroot_is_the_probe_of_it():
    """``doctor --sysroot``: the probe of the fixture, without asking this machine's Vulkan or ROCm
    runtimes (which see this machine, not the fixture)."""
    report = LocalServices().hardware_report(str(SYSROOTS / "nvidia-rtx4080"), utilization=0.5)
    assert report.backend == "cuda" and report.recommended_backend == "cuda"
    assert "adapters_problem" not in report.runtimes["vulkan"]
    assert "runtime" not in report.runtimes["rocm"]  # set only by asking llmchat's ROCm runtime
    full = LocalServices().hardware_report(str(SYSROOTS / "nvidia-rtx4080"))
    assert report.memory_budget_bytes < full.memory_budget_bytes  # 0.5 of the memory, not 0.85
    with pytest.raises(LlmchatError):
        LocalServices().hardware_report(str(SYSROOTS / "nvidia-rtx4080"), utilization=1.5)


def test_a_servers_models_are_not_built_here():
    with pytest.raises(LlmchatError) as err:
        RemoteServices("http://127.0.0.1:9").build_bundle("m", "cuda", "sm_90", Path("out"))
    assert "127.0.0.1:9/v1" in err.value.problem and "without --endpoint" in err.value.fix


def test_build_bundle_names_what_it_wrote(tiny_model_dir, tmp_path):
    """A real CPU build (for this CPU: the library the test above compiled, from the cache): the
    bundle's folder holds the manifest whose sha256 and key it reports."""
    import hashlib
    import json

    model_dir: Path = tiny_model_dir("llama", "q4f32_1")
    bundle = LocalServices().build_bundle(model_dir, "cpu", None, tmp_path / "out")
    assert isinstance(bundle, Bundle) and bundle.folder.parent == tmp_path / "out"
    manifest = bundle.folder / "manifest.json"
    assert bundle.manifest_sha256 == hashlib.sha256(manifest.read_bytes()).hexdigest()
    key = json.loads(manifest.read_text())["key"]
    assert (bundle.tvm, bundle.engine, bundle.host_cpu) == (key["tvm"], key["engine"], key["host_cpu"])
    assert bundle.target.startswith("cpu")


def test_saved_servers_through_the_facade():
    servers = LocalServices().servers
    assert servers.name_of("server:box") == "box" and servers.name_of("smollm2-135m-instruct") is None
    assert servers.name_of(None) is None
    assert servers.default_name("gpu-box:8000") == "gpu-box:8000"
    saved = servers.save("box", "127.0.0.1:8000", "m1", None)
    assert (saved.endpoint, saved.ref) == ("http://127.0.0.1:8000/v1", "server:box")
    assert servers.load() == [saved] and RemoteServices("http://h:1").servers.load() == [saved]
    servers.remove("box")
    assert servers.load() == []
    with pytest.raises(LlmchatError, match="no saved server 'box'"):
        servers.remove("box")


def test_fetch_models_asks_the_server_and_says_what_to_fix():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests.inference.test_saved_servers import asgi_server, closed_port

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "m1", "object": "model"}]})

    servers = LocalServices().servers
    with asgi_server(Starlette(routes=[Route("/v1/models", models)])) as url:
        endpoint, found = servers.fetch_models(url.removesuffix("/v1"), None)
    assert endpoint.endswith("/v1") and found == ["m1"]
    with pytest.raises(LlmchatError) as err:
        servers.fetch_models(f"http://127.0.0.1:{closed_port()}", None)
    assert "Cannot reach the server" in err.value.problem and err.value.fix


def test_sampling_rules_check_and_apply():
    rules = LocalServices().sampling
    assert rules.validate("temperature", 1) == 1.0 and isinstance(rules.validate("temperature", 1), float)
    with pytest.raises(LlmchatError) as err:
        rules.validate("temperature", 9)
    assert "temperature" in err.value.problem
    assert rules.parse_set("temperature=0.5; stop=###,END") == {"temperature": 0.5, "stop": ["###", "END"]}
    defaults = ModelSampling(SamplingParams(temperature=0.2, top_p=0.8), {"temperature": "catalog"})
    applied = rules.apply(defaults.params, {"top_p": 0.5, "not_a_setting": 1})
    assert (applied.temperature, applied.top_p) == (0.2, 0.5)
