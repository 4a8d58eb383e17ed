"""The one door into ``app/inference/`` for the UI and the CLI: probe the hardware, list the catalog
and what is installed, download, remove, build and load a model, its sampling defaults and rules,
the servers saved in the models screen.

``Services`` is the protocol both sides program against; ``LocalServices`` is the real one (models
on this machine, llmchat's TVM engine or ``engine="mlc"``: MLC-LLM's), ``RemoteServices`` the one
of ``--endpoint URL`` (the models are a server's; nothing is downloaded or compiled here). Two small
parts hang off every one of them: ``servers`` (``SavedServers``: the servers saved in the models
screen) and ``sampling`` (``SamplingRules``: checking and applying sampling settings).
Outside ``app/inference/``, the UI and the CLI import only this module and ``app.inference.api``
(the types); ``tests/test_facade_imports.py`` holds them to it. Tests
hand the app their own (a ``LocalServices`` subclass with a method replaced: the tiny engine as the
loader, a fixture as the probe).

Everything behind it is imported when a method is called, so ``import app.cli`` stays fast.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from app.errors import LlmchatError
from app.inference.api import Engine, ModelSampling, ProgressCallback, SamplingParams, SavedServer

if TYPE_CHECKING:
    from app.cleanup import CleanReport
    from app.inference.hardware import HardwareReport
    from app.inference.hardware.copy_bandwidth import CopyBandwidth
    from app.inference.store.bench_store import BenchResult
    from app.inference.store.catalog import Catalog, CatalogEntry
    from app.inference.store.fit import FitEstimate
    from app.inference.store.speed import SpeedEstimate

#: the model a first run offers and ``ask``/``bench``/``serve`` use without ``--model``
DEFAULT_MODEL_ID = "smollm2-135m-instruct"

EngineKind = Literal["tvm", "mlc"]
SpeedFunction = Callable[["CatalogEntry"], "SpeedEstimate | None"]


@dataclass(frozen=True)
class Bundle:
    """A prebuilt bundle ``llmchat build`` wrote: its folder, what its library is for and its
    manifest's sha256."""

    folder: Path
    target: str
    tvm: str
    engine: str
    host_cpu: str
    manifest_sha256: str


class SavedServers:
    """The servers saved in the models screen ("add a server"), chatted with as ``server:NAME``."""

    def name_of(self, model: str | None) -> str | None:
        """NAME for ``server:NAME``, else None (a local model id or path)."""
        from app.inference.store.saved_servers import server_name_of

        return server_name_of(model)

    def load(self) -> list[SavedServer]:
        """The saved servers (``LlmchatError`` with the fix when the file is damaged or unreadable)."""
        from app.inference.store.saved_servers import load_servers

        return load_servers()

    def fetch_models(self, url: str, api_key: str | None) -> tuple[str, list[str]]:
        """(the normalized endpoint, the models its ``/v1/models`` lists); errors say what the form
        should change."""
        from app.inference.engine.remote import list_models, normalize_endpoint
        from app.inference.store.saved_servers import form_hints

        endpoint = normalize_endpoint(url)
        return endpoint, list_models(endpoint, api_key, hints=form_hints())

    def key_store_name(self) -> str:
        """Where a key saved now would be kept, in words (may ask D-Bus: not on the UI thread)."""
        from app.inference.store.saved_servers import key_store_name

        return key_store_name()

    def default_name(self, url: str) -> str:
        """``host:port`` of a server's URL: the name the form proposes."""
        from app.inference.engine.remote import normalize_endpoint
        from app.inference.store.saved_servers import default_name

        return default_name(normalize_endpoint(url))

    def save(self, name: str, url: str, model: str, api_key: str | None) -> SavedServer:
        from app.inference.store.saved_servers import save_server

        return save_server(name, url, model, api_key)

    def remove(self, name: str) -> None:
        from app.inference.store.saved_servers import remove_server

        remove_server(name)


class SamplingRules:
    """Sampling settings as the user types them (``/set``, the command line's flags): checked against
    their ranges, and laid over a model's defaults."""

    def validate(self, key: str, value: Any) -> Any:
        """One setting, checked (``LlmchatError`` naming the key and its range); ints widened to
        float where a float is meant."""
        from app.inference.engine.sampling import validate_value

        return validate_value(key, value)

    def parse_set(self, text: str) -> dict[str, Any]:
        """``/set temperature=0.5; top_p=0.9; stop=###,END`` -> the checked settings."""
        from app.inference.engine.sampling import parse_set_command

        return parse_set_command(text)

    def apply(self, defaults: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
        """``defaults`` with the user's (checked) overrides on top."""
        from app.inference.engine.model_defaults import effective_params

        return effective_params(defaults, overrides)


@runtime_checkable
class Services(Protocol):
    """What the UI and the CLI call outside themselves."""

    #: the model offered first (empty for a server's models)
    default_model_id: str
    #: the OpenAI-compatible server the models live on (``--endpoint``), or None: local models
    remote_endpoint: str | None
    #: the servers saved in the models screen
    servers: SavedServers
    #: checking and applying sampling settings
    sampling: SamplingRules

    def probe(self) -> HardwareReport:
        """The hardware probe's report, made once per process and shared."""
        ...

    def hardware_report(self, sysroot: str | None = None, utilization: float = 0.85) -> HardwareReport:
        """A fresh probe for ``llmchat doctor``: of the system under ``sysroot`` (None: $LLMCHAT_SYSROOT
        or /), with ``utilization`` of GPU memory for the model; on this machine (no ``sysroot``)
        also what llmchat's Vulkan and ROCm runtimes see."""
        ...

    def forget_probe(self) -> None:
        """The next ``probe`` probes afresh (the hardware screen's refresh)."""
        ...

    def load_catalog(self) -> Catalog: ...

    def list_installed(self) -> list[str]: ...

    def installed_model_path(self, model_id: str) -> Path | None: ...

    def install_problem(self, model_id: str) -> str | None:
        """What is visibly wrong with an installed model (missing or damaged files), or None."""
        ...

    def fit(self, entry: CatalogEntry, report: HardwareReport | None) -> str:
        """'fits', 'tight', 'does not fit' or 'unknown' for a catalog entry on the probed hardware."""
        ...

    def speed(self, report: HardwareReport | None) -> SpeedFunction:
        """entry -> its estimated decode speed on the probed hardware (None: unknown)."""
        ...

    def download_model(
        self, model_id: str, progress: ProgressCallback | None = None, cancel: threading.Event | None = None
    ) -> Path:
        """Download, or check and repair an installed model; its directory."""
        ...

    def prepare_library(
        self,
        model_id: str,
        model_dir: Path,
        device: str,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> str:
        """After a download: the prebuilt library that fits, or why the library compiles on first use."""
        ...

    def remove_model(self, model_id: str) -> CleanReport: ...

    def build_bundle(
        self,
        model: str | Path,
        device: str,
        arch: str | None,
        out: Path,
        progress: ProgressCallback | None = None,
    ) -> Bundle:
        """Compile ``model``'s library for ``device``/``arch`` (the device need not be here with an
        ``arch``) and write it as a prebuilt bundle under ``out``."""
        ...

    def check_device(self, device: str) -> None:
        """Raise ``LlmchatError`` (with the fix) when ``device`` cannot run here."""
        ...

    def model_or_default(self, model: str | None, progress: ProgressCallback | None = None) -> str | Path:
        """``model``, or the default model (set up on first use)."""
        ...

    def load_engine(self, model: str | Path, device: str, progress: ProgressCallback | None = None) -> Engine:
        """A model (catalog id, installed id or directory) loaded on ``device``, ready to chat."""
        ...

    def open_server(self, name: str) -> Engine:
        """A server saved in the models screen, by name (``--model server:NAME``), as an engine."""
        ...

    def sampling_defaults(self, engine: Engine) -> ModelSampling:
        """The sampling values a chat with ``engine``'s model starts from, and where each comes from."""
        ...


class LocalServices:
    """Models on this machine: llmchat's TVM engine (or MLC-LLM's, ``engine="mlc"``).

    ``context_window``: the KV cache's size (None: the model's, at most 8192); ``prebuilt``: False
    always compiles the model library here (``--no-prebuilt``), None lets the settings decide;
    ``arch``: the GPU architecture or CPU level to compile for (None: this machine's)."""

    remote_endpoint: str | None = None
    servers: SavedServers = SavedServers()
    sampling: SamplingRules = SamplingRules()

    def __init__(
        self,
        engine: EngineKind = "tvm",
        context_window: int | None = None,
        prebuilt: bool | None = None,
        arch: str | None = None,
        default_model_id: str = DEFAULT_MODEL_ID,
    ) -> None:
        self.engine = engine
        self.context_window = context_window
        self.prebuilt = prebuilt
        self.arch = arch
        self.default_model_id = default_model_id

    # -- hardware ------------------------------------------------------------------------------
    def probe(self) -> HardwareReport:
        from app.inference.hardware import shared_probe

        return shared_probe()

    def forget_probe(self) -> None:
        from app.inference.hardware import forget_shared_probe

        forget_shared_probe()

    def hardware_report(self, sysroot: str | None = None, utilization: float = 0.85) -> HardwareReport:
        from app.inference.hardware import probe

        report = probe(sysroot, utilization=utilization)
        if not sysroot:
            from app.inference.backends.runtime_status import add_runtime_status

            add_runtime_status(report)
        return report

    def copy_bandwidth(self, device: Any = None) -> CopyBandwidth:
        """The device's copy bandwidth (a TVM device; None: the CPU), measured once and kept
        (``LlmchatError`` when no copy can be measured)."""
        from app.inference.hardware import copy_bandwidth

        return copy_bandwidth.cached(device)

    def check_device(self, device: str) -> None:
        if self.engine != "tvm":  # MLC-LLM resolves its own devices
            return
        from app.inference.hardware.device_spec import resolve_device

        resolve_device(device or "auto")

    # -- store ---------------------------------------------------------------------------------
    def load_catalog(self) -> Catalog:
        from app.inference.store.catalog import load_catalog

        return load_catalog()

    def list_installed(self) -> list[str]:
        from app.inference.store.catalog import list_installed

        return list_installed()

    def installed_model_path(self, model_id: str) -> Path | None:
        from app.inference.store.catalog import installed_model_path

        return installed_model_path(model_id)

    def install_problem(self, model_id: str) -> str | None:
        from app.inference.store.installed import quick_problem

        path = self.installed_model_path(model_id)
        return quick_problem(path) if path is not None else None

    def fit(self, entry: CatalogEntry, report: HardwareReport | None) -> str:
        return str(self.fit_estimate(entry, getattr(report, "memory_budget_bytes", None)).verdict)

    def fit_estimate(
        self, entry: CatalogEntry, budget_bytes: int | None, context: int | None = None
    ) -> FitEstimate:
        """Weights + KV cache at ``context`` + workspace against ``budget_bytes``, and the largest context."""
        from app.inference.store.fit import estimate

        return estimate(entry, budget_bytes, context)

    def repair_fix(self, model_id: str) -> str | None:
        """The command that repairs an installed model here (None: not installed)."""
        from app.inference.store.installed import repair_fix

        path = self.installed_model_path(model_id)
        return repair_fix(path) if path is not None else None

    def cpu_level(self) -> str:
        """The x86-64 level (or ``native``) CPU model libraries are compiled for here."""
        from app.inference.compile.targets import cpu_level

        return cpu_level()

    def library_status(self, entry: CatalogEntry | None, backend: str, arch: str | None) -> str:
        """The model library column: a prebuilt library for this machine, or what compiling costs."""
        from app.inference.compile.prebuilt import catalog_status

        return catalog_status(entry, backend, arch)

    def speed(self, report: HardwareReport | None) -> SpeedFunction:
        from app.inference.store.speed import speed_function

        return speed_function(report)

    def record_bench(self, result: dict) -> BenchResult | None:
        """Keep what ``llmchat bench`` measured, for the catalog's speed estimates."""
        from app.inference.store import bench_store

        return bench_store.record(result)

    def download_model(
        self, model_id: str, progress: ProgressCallback | None = None, cancel: threading.Event | None = None
    ) -> Path:
        from app.inference.store.downloads import download_model

        return download_model(model_id, progress, cancel)

    def prepare_library(
        self,
        model_id: str,
        model_dir: Path,
        device: str,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> str:
        from app.inference.compile.prebuilt import prepare_library

        return prepare_library(model_id, Path(model_dir), device, self.prebuilt, progress, cancel)

    def remove_model(self, model_id: str) -> CleanReport:
        """Remove an installed model (an id, or ``HF://owner/repo``), its partial download and what
        interrupted runs left of it; what was removed and the bytes reclaimed."""
        from app.inference.store.catalog import id_for_hf_repo, parse_hf_reference, remove_model_report

        repo = parse_hf_reference(model_id)
        if repo is not None:
            entry = self.load_catalog().find_hf_repo(repo)
            model_id = entry.id if entry else id_for_hf_repo(repo)
        return remove_model_report(model_id)

    def build_bundle(
        self,
        model: str | Path,
        device: str,
        arch: str | None,
        out: Path,
        progress: ProgressCallback | None = None,
    ) -> Bundle:
        from app.inference.compile import cache, prebuilt

        folder = prebuilt.build_bundle(model, device, arch, out, progress)
        key = prebuilt.parse_manifest((folder / prebuilt.MANIFEST).read_bytes()).key
        digest = cache.file_digest(folder / prebuilt.MANIFEST)
        return Bundle(folder, key.target, key.tvm, key.engine, key.host_cpu, digest)

    def import_gguf(
        self, path: str | Path, name: str | None = None, progress: ProgressCallback | None = None
    ) -> Path:
        """A GGUF file imported losslessly as an installed model; its directory."""
        from app.inference.store.gguf_import import import_gguf

        return import_gguf(path, name=name, progress=progress)

    def model_or_default(self, model: str | None, progress: ProgressCallback | None = None) -> str | Path:
        try:
            from app.inference.store.default_model import model_or_default
        except ImportError:
            if model:
                return model
            raise LlmchatError(
                "No --model given and the default model is not available in this build.",
                "pass --model ID_OR_PATH (see `llmchat models`)",
            ) from None
        return model_or_default(model, progress)

    # -- engine --------------------------------------------------------------------------------
    def load_engine(self, model: str | Path, device: str, progress: ProgressCallback | None = None) -> Engine:
        if self.engine == "mlc":
            from app.inference.engine.mlc_engine import MLCLLMEngine
            from app.inference.engine.tvm_engine import resolve_model_dir

            model_id, model_dir = resolve_model_dir(model)
            return MLCLLMEngine(model_dir, device=device, model_id=model_id, progress=progress)
        from app.inference.engine.tvm_engine import load_engine

        return load_engine(
            model,
            device=device or "auto",
            progress=progress,
            context_window=self.context_window,
            arch=self.arch,
            prebuilt=self.prebuilt,
        )

    def random_presets(self) -> Sequence[str]:
        """The architectures ``bench --random-weights`` can build with random weights."""
        from app.inference.engine.random_model import PRESETS

        return tuple(PRESETS)

    def load_random_engine(
        self, preset: str, quantization: str, device: str, progress: ProgressCallback | None = None
    ) -> Engine:
        """A model of a real architecture's shape with random weights (``bench --random-weights``)."""
        from app.inference.engine.random_model import load_random_engine

        return load_random_engine(
            preset,
            quantization,
            device=device,
            progress=progress,
            context_window=self.context_window,
            arch=self.arch,
        )

    def open_server(self, name: str) -> Engine:
        from app.inference.store.saved_servers import open_server

        return open_server(name)

    def sampling_defaults(self, engine: Engine) -> ModelSampling:
        from app.inference.engine.model_defaults import model_sampling

        return model_sampling(engine.info.model_path, engine.info.model_id)


class RemoteServices(LocalServices):
    """``--endpoint URL``: the models are the server's (``/v1/models``), loading one connects to it;
    nothing is downloaded or compiled here."""

    def __init__(self, endpoint: str, api_key: str | None = None) -> None:
        from app.inference.engine.remote import normalize_endpoint

        super().__init__(default_model_id="")
        self.remote_endpoint = normalize_endpoint(endpoint)
        self.api_key = api_key

    def list_installed(self) -> list[str]:
        from app.inference.engine.remote import list_models

        assert self.remote_endpoint is not None
        return list_models(self.remote_endpoint, self.api_key)

    def installed_model_path(self, model_id: str) -> Path | None:
        return None

    def install_problem(self, model_id: str) -> str | None:
        return None

    def check_device(self, device: str) -> None:
        return None  # the server's

    def build_bundle(
        self,
        model: str | Path,
        device: str,
        arch: str | None,
        out: Path,
        progress: ProgressCallback | None = None,
    ) -> Bundle:
        raise LlmchatError(
            f"Model libraries are not built for a server's models ({self.remote_endpoint}).",
            "run llmchat build without --endpoint, on an installed model or a model directory",
        )

    def model_or_default(self, model: str | None, progress: ProgressCallback | None = None) -> str | Path:
        return model or ""  # empty: the first model the server lists

    def download_model(
        self, model_id: str, progress: ProgressCallback | None = None, cancel: threading.Event | None = None
    ) -> Path:
        raise LlmchatError(
            f"{model_id} is not on the server at {self.remote_endpoint}.", "pick one of its models"
        )

    def load_engine(self, model: str | Path, device: str, progress: ProgressCallback | None = None) -> Engine:
        from app.inference.engine.remote import RemoteEngine

        assert self.remote_endpoint is not None
        return RemoteEngine(self.remote_endpoint, api_key=self.api_key, model=str(model) or None)
