"""Loading what the models and first-run screens show, off the UI thread: catalog, installed, fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from textual import work
from textual.message import Message

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp


@dataclass
class CatalogData:
    """The catalog entries, the installed ids and the hardware report (None when the probe failed)."""

    entries: list[Any] = field(default_factory=list)
    installed: set[str] = field(default_factory=set)
    broken: dict[str, str] = field(default_factory=dict)  # installed id -> what is wrong with it
    report: Any = None
    probe_error: BaseException | None = None
    speeds: dict[str, Any] = field(default_factory=dict)  # id -> SpeedEstimate (or None: unknown)


class CatalogLoaded(Message):
    """Posted by a worker thread with the data, or the error that stopped it."""

    def __init__(self, data: CatalogData | None, error: BaseException | None) -> None:
        super().__init__()
        self.data = data
        self.error = error


def load_catalog_data(app: LlmchatApp) -> CatalogData:
    """Call from a worker thread: probe (once per app), catalog and installed models."""
    data = CatalogData()
    if app.hardware_report is None:
        try:
            app.hardware_report = app.services.probe()
        except Exception as err:  # the catalog is still useful without fit badges
            data.probe_error = err
    data.report = app.hardware_report
    data.entries = list(app.services.load_catalog().entries)
    data.installed = set(app.services.list_installed())
    data.speeds = estimate_speeds(app, data.report, data.entries)
    for model_id in sorted(data.installed):
        try:
            problem = app.services.install_problem(model_id)
        except Exception as err:  # a check that fails says so rather than hiding the row
            problem = f"cannot be checked ({err})"
        if problem:
            data.broken[model_id] = problem
    return data


def estimate_speeds(app: LlmchatApp, report: Any, entries: list[Any]) -> dict[str, Any]:
    """Each entry's estimated decode speed here (bench results read once); None where unknown."""
    try:
        speed = app.services.speed(report)
    except Exception:
        return {}
    speeds = {}
    for entry in entries:
        try:
            speeds[entry.id] = speed(entry)
        except Exception:
            speeds[entry.id] = None
    return speeds


def fit_function(app: LlmchatApp, report: Any):
    """entry -> 'fits' / 'tight' / 'does not fit' ('?' without a hardware report)."""
    if report is None:
        return lambda entry: "?"
    return lambda entry: app.services.fit(entry, report)


class LoadsCatalog:
    """Mixin for screens that show the catalog: ``load_catalog()`` posts ``CatalogLoaded``."""

    llm_app: LlmchatApp

    @work(thread=True, exclusive=True, group="catalog", exit_on_error=False)
    def load_catalog(self) -> None:
        try:
            data = load_catalog_data(self.llm_app)
        except BaseException as err:
            self.post_message(CatalogLoaded(None, err))  # type: ignore[attr-defined]
            return
        self.post_message(CatalogLoaded(data, None))  # type: ignore[attr-defined]
