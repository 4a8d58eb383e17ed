"""The debug log: what llmchat swallows on purpose (a kernel rule that did not fit, a probe that
failed, pinned memory that was refused …) so that a silent fallback to slower code or to the CPU
can be seen.

Everything goes to ``cache_dir()/debug.log`` (stdlib ``logging``, a rotating file handler: 1 MB,
two old files kept); ``--verbose`` also prints it on stderr. Modules log with
``from app.debug_log import log`` and ``log.debug(...)`` / ``log.info(..., exc_info=True)``.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys

from app import paths

log = logging.getLogger("llmchat")

#: the rotating file's size limit and how many older files are kept
MAX_BYTES = 1 << 20
BACKUPS = 2
_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"


def log_path():
    return paths.cache_dir() / "debug.log"


def setup(verbose: bool = False) -> None:
    """Attach the file handler (and a stderr one when ``verbose``); safe to call more than once.

    A cache directory that cannot be written leaves the file out: logging never stops a start."""
    log.setLevel(logging.DEBUG)
    log.propagate = False
    if not any(isinstance(h, logging.handlers.RotatingFileHandler) for h in log.handlers):
        try:
            path = log_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.handlers.RotatingFileHandler(
                path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8", delay=False
            )
        except OSError:
            handler = None
        if handler is not None:
            handler.setFormatter(logging.Formatter(_FORMAT))
            log.addHandler(handler)
    if verbose and not any(getattr(h, "_llmchat_verbose", False) for h in log.handlers):
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("llmchat[debug]: %(message)s"))
        stream._llmchat_verbose = True  # type: ignore[attr-defined]
        log.addHandler(stream)


def close() -> None:
    """Detach and close every handler (tests; a changed cache directory)."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
