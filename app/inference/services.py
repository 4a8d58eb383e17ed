"""The one door into ``app/inference/`` for the UI and the CLI: probe the hardware, list the catalog
and what is installed, download, remove, load a model, its sampling defaults.

``Services`` is the protocol both sides program against; ``LocalServices`` is the real one (models
on this machine, llmchat's TVM engine or ``engine="mlc"``: MLC-LLM's), ``RemoteServices`` the one
of ``--endpoint URL`` (the models are a server's; nothing is downloaded or compiled here). Tests
hand the app their own (a ``LocalServices`` subclass with a method replaced: the tiny engine as the
loader, a fixture as the probe).

Everything behind it is imported when a method is called, so ``import app.cli`` stays fast.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from app.errors import LlmchatError
from app.inference.api import Engine, ProgressCallback

if TYPE_CHECKING:
    from app.cleanup import CleanReport
    from app.inference.engine.model_defaults import ModelSampling
    from app.inference.hardware import HardwareReport
    from app.inference.store.bench_store import BenchResult
    from app.inference.store.catalog import Catalog, CatalogEntry
    from app.inference.store.fit import FitEstimate
    from app.inference.store.speed import SpeedEstimate

#: the model a first run offers and ``ask``/``bench``/``serve`` use without ``--model``
DEFAULT_MODEL_ID = "smollm2-135m-instruct"

EngineKind = Literal["tvm", "mlc"]
SpeedFunction = Callable[["CatalogEntry"], "SpeedEstimate | None"]


@runtime_checkable
class Services(Protocol):
    """What the UI and the CLI call outside themselves."""

    #: the model offered first (empty for a server's models)
    default_model_id: str
    #: the OpenAI-compatible server the models live on (``--endpoint``), or None: local models
    remote_endpoint: str | None

    def probe(self) -> HardwareReport:
        """The hardware probe's report, made once per process and shared."""
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
