"""The model catalog as a table: size, context, fit badge and estimated speed on this machine,
installed state."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from app.units import format_bytes

#: widest Model column
MODEL_WIDTH = 28
FIT_STYLES = {"fits": "green", "tight": "yellow", "does not fit": "red"}


def human_count(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}".replace(".0", "")
    return str(count)


def human_bytes(count: int | float | None) -> str:
    return format_bytes(count) if count else "?"


def human_context(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


def speed_cell(estimate: Any) -> Text:
    """``~12 tok/s`` (a second line "slow", red, below SLOW_TOK_S); "?" when unknown."""
    if estimate is None:
        return Text("?", style="dim")
    figure = estimate.short().removesuffix(" slow")
    if estimate.slow:
        return Text.assemble((figure, "red"), "\n", ("slow", "bold red"))
    return Text(figure)


def fit_badge(verdict: str) -> Text:
    """A coloured fit badge ('fits', 'tight', 'does not fit'; anything else dim)."""
    return Text(verdict, style=FIT_STYLES.get(verdict.lower(), "dim"))


class CatalogTable(DataTable):
    """One row per catalog entry, keyed by the model id."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        self.add_columns("Model", "Params", "Download", "Context", "Fit", "Speed", "Installed")

    def show(
        self,
        entries: Iterable[Any],
        installed: set[str],
        fit: Callable[[Any], str],
        select: str | None = None,
        speeds: dict[str, Any] | None = None,
        broken: dict[str, str] | None = None,
    ) -> None:
        """Fill the table and put the cursor on ``select`` (e.g. the default model); ``speeds``: the
        estimated decode speed per id (``app.inference.store.speed.SpeedEstimate``)."""
        entries = list(entries)
        # explicit widths: auto-sized two-line cells were sometimes measured before they had content
        # at most MODEL_WIDTH: every column fits a 100-column terminal (a longer name is cut with "…")
        model_width = min(MODEL_WIDTH, max([len("Model"), *(max(len(e.id), len(e.name)) for e in entries)]))
        self.clear(columns=True)
        self.add_column("Model", width=model_width)
        columns = (
            ("Params", 6),
            ("Download", 9),
            ("Context", 7),
            ("Fit", 12),
            ("Speed", 12),
            ("Installed", 9),
        )
        for label, width in columns:
            self.add_column(label, width=width)
        for entry in entries:
            try:
                verdict = fit(entry)
            except Exception:
                verdict = "?"
            self.add_row(
                Text(
                    f"{entry.id}\n{entry.name}" if entry.name != entry.id else entry.id,
                    no_wrap=True,
                    overflow="ellipsis",
                ),
                human_count(entry.parameters),
                human_bytes(entry.download_bytes),
                human_context(entry.context_window),
                fit_badge(verdict),
                speed_cell((speeds or {}).get(entry.id)),
                _installed_cell(entry.id, installed, broken or {}),
                key=entry.id,
                height=2 if entry.name != entry.id or self._slow(speeds, entry.id) else 1,
            )
        if select is not None:
            self.select(select)

    @staticmethod
    def _slow(speeds: dict[str, Any] | None, model_id: str) -> bool:
        estimate = (speeds or {}).get(model_id)
        return bool(estimate is not None and estimate.slow)

    def select(self, model_id: str) -> None:
        with contextlib.suppress(Exception):
            self.move_cursor(row=self.get_row_index(model_id))

    @property
    def selected_id(self) -> str | None:
        if self.row_count == 0:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return str(row_key.value)


def _installed_cell(model_id: str, installed: set[str], broken: dict[str, str]) -> Text:
    if model_id in broken:
        return Text("⚠ broken", style="bold red")
    return Text("✓ yes", style="green") if model_id in installed else Text("—", style="dim")
