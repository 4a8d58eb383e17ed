"""`llmchat download`: download a model's prebuilt quantized weights (progress on stderr)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import TYPE_CHECKING

from app.errors import LlmchatError

if TYPE_CHECKING:
    from app.inference.services import LocalServices

HELP = "download a model's prebuilt quantized weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="ID_OR_HF_REPO", help="catalog id (see `llmchat models`) or HF://owner/repo"
    )
    parser.add_argument(
        "--device",
        dest="lib_device",
        default="auto",
        help="the device whose prebuilt model library to fetch (default: auto)",
    )
    from app.cli import add_prebuilt_argument

    add_prebuilt_argument(parser, default=argparse.SUPPRESS)


class ProgressBar:
    """Draws download progress on stderr: one redrawn line on a terminal, a line every few s otherwise."""

    def __init__(self, stream=None, width: int = 30, log_every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = log_every_s
        self._last_log = 0.0
        self._drawn = False

    def __call__(self, event) -> None:
        fraction = event.fraction
        if fraction is None or (event.done in (None, 0) and not self.tty):
            self._line(event.message)
            return
        if self.tty:
            filled = int(self.width * fraction)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r[{bar}] {fraction * 100:5.1f}% {event.message}\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif time.monotonic() - self._last_log >= self.log_every_s or fraction >= 1.0:
            self._last_log = time.monotonic()
            self._line(f"{fraction * 100:5.1f}% {event.message}")

    def _line(self, text: str) -> None:
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def run(args: argparse.Namespace) -> int:
    from app.cli import prebuilt_choice
    from app.inference.api import DownloadCancelled
    from app.inference.services import LocalServices

    services = LocalServices(prebuilt=prebuilt_choice(args))
    bar = ProgressBar()
    cancel = threading.Event()
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["path"] = services.download_model(args.model, bar, cancel)
            outcome["library"] = library_step(services, outcome["path"], args, bar, cancel)
        except BaseException as err:  # handed to the main thread
            outcome["error"] = err

    worker = threading.Thread(target=work, name="download", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        cancel.set()
        worker.join(30)
        bar.finish()
        print("llmchat: download cancelled; run the same command again to resume", file=sys.stderr)
        return 130
    bar.finish()
    error = outcome.get("error")
    if isinstance(error, DownloadCancelled):
        print(f"llmchat: {error}", file=sys.stderr)
        return 130
    if isinstance(error, LlmchatError):
        raise error
    if error is not None:
        raise error  # type: ignore[misc]
    if outcome.get("library"):
        print(f"llmchat: {outcome['library']}", file=sys.stderr)
    print(outcome["path"])
    return 0


def library_step(
    services: LocalServices, model_dir, args: argparse.Namespace, progress, cancel: threading.Event
) -> str | None:
    """The model's library after the weights: the prebuilt one that fits this machine, or a line
    saying it compiles on first use and why.  Nothing for a model whose library cannot be told
    (a repo without a usable config), where the first load says it."""
    from pathlib import Path

    from app.inference.api import DownloadCancelled

    model_dir = Path(model_dir)
    try:
        return services.prepare_library(
            model_dir.name, model_dir, getattr(args, "lib_device", "auto") or "auto", progress, cancel
        )
    except DownloadCancelled:
        raise
    except Exception as err:  # the weights are installed: the library step never undoes that
        why = err.problem if isinstance(err, LlmchatError) else f"{type(err).__name__}: {err}"
        return f"the model library compiles here on first use ({why})"
