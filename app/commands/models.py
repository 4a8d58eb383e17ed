"""`llmchat models`: list the model catalog with size, fit on this machine and installed state."""

from __future__ import annotations

import argparse
import json
import threading
from typing import Any

from app.units import GIB, format_bytes

HELP = "list the model catalog with size, fit on this machine and installed state"

#: the hardware probe gets this long before fit is shown as "unknown" (the command answers in < 1 s)
PROBE_TIMEOUT_S = 0.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the catalog as JSON")
    parser.add_argument(
        "--memory",
        type=float,
        metavar="GIB",
        help="memory budget for the fit estimate in GiB (default: what the hardware probe reports)",
    )
    parser.add_argument(
        "--context", type=int, metavar="TOKENS", help="context length for the fit estimate (default 4096)"
    )


def probe_report(timeout_s: float = PROBE_TIMEOUT_S) -> Any:
    """The hardware probe's report, or None when the probe is missing, fails or is too slow."""
    result: list[Any] = [None]

    def run_probe() -> None:
        try:
            from app.inference.services import LocalServices

            result[0] = LocalServices().probe()
        except Exception:  # the probe belongs to another module: any failure means "unknown"
            result[0] = None

    worker = threading.Thread(target=run_probe, name="hardware-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return result[0]


def budget_of(report: Any) -> int | None:
    budget = getattr(report, "memory_budget_bytes", None)
    return int(budget) if budget else None


def memory_budget_bytes(timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """The probe's memory budget, or None when the probe is missing, fails or is too slow."""
    return budget_of(probe_report(timeout_s))


def _size(n: int) -> str:
    return format_bytes(n)


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def machine_target(timeout_s: float = PROBE_TIMEOUT_S, report: Any = None) -> tuple[str, str | None]:
    """(backend, CPU level or GPU architecture when known) of this machine, for the library column;
    from ``report`` when the caller probed already."""
    result: list[tuple[str, str | None]] = [("cpu", None)]

    def run_probe() -> None:
        try:
            from app.inference.services import LocalServices

            services = LocalServices()
            nonlocal report
            report = report if report is not None else services.probe()
            backend = str(getattr(report, "backend", "cpu") or "cpu")
            arch = services.cpu_level() if backend == "cpu" else None
            result[0] = (backend, arch)
        except Exception:  # the probe belongs to another module: any failure means "cpu, unknown"
            pass

    worker = threading.Thread(target=run_probe, name="hardware-probe-target", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return result[0]


def collect(budget: int | None, context: int | None = None, report: Any = None) -> list[dict]:
    """One row per catalog entry plus installed models outside the catalog; ``report``: the hardware
    probe's, for the estimated decode speed (None: unknown)."""
    from app.inference.services import LocalServices

    services = LocalServices()
    speed = services.speed(report)

    def health(model_id: str) -> dict:
        problem = services.install_problem(model_id)
        return {"broken": problem, "fix": services.repair_fix(model_id) if problem else None}

    catalog = services.load_catalog()
    backend, arch = machine_target(report=report)
    installed = set(services.list_installed())
    rows = []
    for entry in catalog.entries:
        est = services.fit_estimate(entry, budget, context)
        estimate = speed(entry)
        path = services.installed_model_path(entry.id) if entry.id in installed else None
        rows.append(
            {
                "id": entry.id,
                "name": entry.name,
                "source": entry.source.describe(),
                "format": entry.format,
                "architecture": entry.architecture,
                "quantization": entry.quantization,
                "parameters": entry.parameters,
                "download_bytes": entry.download_bytes,
                "context_window": entry.context_window,
                "license": entry.license,
                "gated": entry.gated,
                "origin": entry.origin,
                "installed": path is not None,
                "path": str(path) if path else None,
                **(health(entry.id) if path is not None else {"broken": None, "fix": None}),
                "library": services.library_status(entry, backend, arch),
                "fit": {
                    "verdict": est.verdict,
                    "context": est.context,
                    "needed_bytes": est.total_bytes,
                    "budget_bytes": est.budget_bytes,
                    "max_context": est.max_context if est.max_context >= 0 else None,
                },
                "speed": estimate.to_dict() if estimate is not None else None,
            }
        )
    known = {row["id"] for row in rows}
    for model_id in sorted(installed - known):
        path = services.installed_model_path(model_id)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path else 0
        rows.append(
            {
                "id": model_id,
                "name": model_id,
                "source": "local",
                "format": None,
                "architecture": None,
                "quantization": None,
                "parameters": None,
                "download_bytes": size,
                "context_window": None,
                "license": None,
                "gated": None,
                "origin": "installed",
                "installed": True,
                "path": str(path) if path else None,
                **(health(model_id) if path is not None else {"broken": None, "fix": None}),
                "library": services.library_status(None, backend, arch),
                "fit": {
                    "verdict": "unknown",
                    "context": None,
                    "needed_bytes": None,
                    "budget_bytes": budget,
                    "max_context": None,
                },
                "speed": None,
            }
        )
    return rows


def _fit_text(row: dict) -> str:
    fit = row["fit"]
    if fit["verdict"] == "unknown":
        return "unknown"
    max_ctx = fit["max_context"]
    return f"{fit['verdict']} (max ctx {max_ctx})" if max_ctx else fit["verdict"]


def _speed_text(row: dict) -> str:
    speed = row["speed"]
    if speed is None:
        return "?"
    tok_s = speed["decode_tok_s"]
    figure = f"{tok_s:.1f}" if tok_s < 10 else f"{tok_s:.0f}"
    return f"~{figure} tok/s" + (" SLOW" if speed["slow"] else "")


def run(args: argparse.Namespace) -> int:
    report = probe_report()
    budget = int(args.memory * GIB) if args.memory else budget_of(report)
    rows = collect(budget, args.context, report)
    if args.json:
        print(json.dumps({"memory_budget_bytes": budget, "models": rows}, indent=2))
        return 0
    header = ("ID", "PARAMS", "SIZE", "CONTEXT", "FIT", "SPEED", "LIBRARY", "INSTALLED")
    table = [header]
    for row in rows:
        table.append(
            (
                row["id"],
                _params(row["parameters"]) if row["parameters"] else "-",
                _size(row["download_bytes"]),
                str(row["context_window"] or "-"),
                _fit_text(row),
                _speed_text(row),
                row["library"],
                ("broken" if row["broken"] else "yes") if row["installed"] else "",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    for row in rows:
        if row["broken"]:
            print(f"\n{row['id']} is broken: {row['broken']}\n  fix: {row['fix']}")
    context = args.context or 4096
    memory = format_bytes(budget) if budget else "unknown (pass --memory GIB)"
    print(f"\nfit at {context} tokens of context, memory budget {memory}; `llmchat download ID` to get one")
    return 0
