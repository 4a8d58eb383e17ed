"""Build a model library with TVM: export the model's IRModule, compile it with llmchat's pipeline
(TVM's stock one when llmchat's schedules fail) and write the shared library atomically.

The caller names the library's file (``compiler.compile_into``); TVM's temporary files go to a
scratch directory in the cache, removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent
from app.inference.compile import cache
from app.inference.compile.rocm_toolchain import rocm_toolchain
from app.inference.store.config import ModelConfig

#: number of compilations done in this process (tests assert cache hits with it)
COMPILE_COUNT = 0


def export_model(cfg: ModelConfig, target: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """The Relax IRModule of the model and its named parameters (export order)."""
    from app.inference.models import model_class

    model = model_class(cfg.model_type)(cfg, target)
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    return mod, named_params


def param_list(named_params: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """JSON-able ``[{"name", "shape", "dtype"}]`` from ``export_tvm``'s named params."""
    return [{"name": n, "shape": [int(x) for x in p.shape], "dtype": str(p.dtype)} for n, p in named_params]


def parameter_specs(cfg: ModelConfig) -> list[dict[str, Any]]:
    """The model's parameters (name, shape, dtype) in export order, without compiling."""
    from app.inference.models import model_class

    model = model_class(cfg.model_type)(cfg, None)
    return param_list(list(model.named_parameters()))


def _pass_config(target: Any) -> dict[str, Any]:
    try:
        from app.inference import pipelines

        fn = getattr(pipelines, "pass_config_for", None)
        return dict(fn(target)) if fn else {}
    except ImportError:
        return {}


def _build_hooks(target: Any) -> contextlib.AbstractContextManager[Any]:
    """ROCm: find the toolchain; CUDA: turn kernels into prebuilt fatbins (``compile.cuda_support``);
    WebGPU: a kernel parameter accessed only by aligned vector ramps is bound as vectors
    (``pipelines.wgsl_vector_params``, on every WebGPU build, so a library never depends on what
    the process built before it)."""
    if target.kind.name == "rocm":
        return rocm_toolchain()
    if target.kind.name == "webgpu":
        from app.inference.pipelines.wgsl_vector_params import install

        install()
        return contextlib.nullcontext()
    if target.kind.name != "cuda":
        return contextlib.nullcontext()
    try:
        from app.inference.compile.cuda_support import cuda_build_hooks
    except ImportError:
        return contextlib.nullcontext()
    return cuda_build_hooks(target)


def _without_device_argmax(mod: Any) -> Any:
    """``mod`` without the exported ``argmax`` and its kernel: TVM's stock pipeline cannot
    schedule that reduction for GPUs, and the runtime does without it (host argmax)."""
    import tvm
    from tvm import relax

    names = [gv.name_hint for gv in mod.functions]
    if "argmax" not in names:
        return mod
    kept = {gv: f for gv, f in mod.functions.items() if gv.name_hint != "argmax"}
    entries = [gv.name_hint for gv, f in kept.items() if isinstance(f, relax.Function)]
    pruned = tvm.IRModule(kept, attrs=mod.attrs)
    return relax.transform.DeadCodeElimination(entries)(pruned)


@contextlib.contextmanager
def _scratch_tempdir() -> Any:
    """TVM's temporary files (export_library's object files) go to ``cache/tmp/build-PID`` instead
    of /tmp, so those of a killed compile are found and removed (app.cleanup)."""
    import shutil

    scratch = paths.cache_dir() / "tmp" / f"build-{os.getpid()}"
    try:
        scratch.mkdir(parents=True, exist_ok=True)
    except OSError:
        yield  # an unwritable cache is reported when the library is written
        return
    old = tempfile.tempdir
    tempfile.tempdir = str(scratch)
    try:
        yield
    finally:
        tempfile.tempdir = old
        shutil.rmtree(scratch, ignore_errors=True)


def _build(mod: Any, target: Any, pipeline: Any, out_path: Path, progress: ProgressCallback | None) -> None:
    """tvm.compile + export_library to ``out_path`` (written to a temp file, then renamed)."""
    import tvm

    if isinstance(pipeline, str) and pipeline == "default":
        mod = _without_device_argmax(mod)
    with (
        _build_hooks(target),
        _scratch_tempdir(),
        tvm.transform.PassContext(opt_level=3, config=_pass_config(target)),
    ):
        from app.inference.pipelines.wgsl_subgroups import tir_pipeline

        executable = tvm.compile(mod, target, relax_pipeline=pipeline, tir_pipeline=tir_pipeline(target))
        if progress:
            progress(ProgressEvent("compile", "writing the library", 2, 3))
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(
                prefix=f"{out_path.stem}.{os.getpid()}.", suffix=".so.tmp", dir=out_path.parent
            )
            os.close(fd)
        except OSError as err:
            raise cache.cache_write_error(out_path.parent, err) from err
        try:
            executable.export_library(tmp)
            os.replace(tmp, out_path)
        except OSError as err:  # full or read-only cache: not a schedule problem, no fallback
            raise cache.cache_write_error(out_path.parent, err) from err
        except Exception as err:
            # export_library runs the system compiler; a full disk surfaces as its failure
            free = _free_bytes(out_path.parent)
            if free is not None and free < (64 << 20):
                raise cache.cache_write_error(
                    out_path.parent, OSError(28, "No space left on device")
                ) from err
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def compile_library(
    cfg: ModelConfig,
    target: Any,
    out_path: Path,
    progress: ProgressCallback | None = None,
    device_label: str | None = None,
    report_pipeline: bool = False,
) -> Any:
    """Compile ``cfg`` for ``target`` into the shared library ``out_path`` (atomic); the parameter
    list (with ``report_pipeline``: ``(params, stock)``, ``stock`` True when TVM's stock pipeline
    stood in for llmchat's failing schedules).

    ``device_label`` (e.g. ``"vulkan:0"``) names the device in progress messages.  A cache that
    cannot be written is reported as such (never as a schedule failure, never retried).
    """
    global COMPILE_COUNT
    import tvm

    from app.inference.pipelines import pipeline_for

    kind = target.kind.name
    if tvm.get_global_func(f"target.build.{kind}", allow_missing=True) is None:
        name = {"vulkan": "Vulkan (SPIR-V)", "rocm": "ROCm", "metal": "Metal", "cuda": "CUDA"}.get(kind, kind)
        raise LlmchatError(
            f"The installed TVM has no {name} code generator, so it cannot build a model library for {kind}.",
            "use --device cpu or --device auto (`llmchat doctor` says what this machine can run)",
        )
    if progress:
        where = device_label or ("cpu" if kind == "llvm" else "vulkan" if kind == "webgpu" else kind)
        progress(
            ProgressEvent("compile", f"compiling for {where} ({cfg.model_type}, {cfg.quantization}) …", 0, 3)
        )
    try:
        mod, named_params = export_model(cfg, target)
    except LlmchatError:
        raise
    except Exception as err:
        raise LlmchatError(
            f"Building the {cfg.model_type} model failed: {type(err).__name__}: {err}",
            "report this with the message above",
        ) from err
    if progress:
        progress(ProgressEvent("compile", "generating kernels", 1, 3))
    stock = cache.stock_pipeline_forced()
    try:
        _build(
            mod,
            target,
            "default" if cache.stock_pipeline_forced() else pipeline_for(target),
            out_path,
            progress,
        )
    except LlmchatError:
        raise
    except Exception as err:  # TVM raises many types; the user gets one clear message
        first = f"{type(err).__name__}: {str(err).strip()[:2000]}"
        if cache.stock_pipeline_forced():
            raise LlmchatError(
                f"Compiling the model for {kind} failed: {first}",
                "run with --device cpu, or report this with the message above",
            ) from err
        # llmchat's kernel schedules failed: TVM's stock pipeline gives slower but working code
        if progress:
            progress(
                ProgressEvent(
                    "compile",
                    f"llmchat's schedules failed ({first[:200]}); "
                    "retrying with TVM's stock pipeline (slower code)",
                    1,
                    3,
                )
            )
        stock = True
        try:
            _build(mod, target, "default", out_path, progress)
        except LlmchatError:
            raise
        except Exception as err2:
            raise LlmchatError(
                f"Compiling the model for {kind} failed: {first}",
                "run with --device cpu, or report this with the message above",
            ) from err2
    COMPILE_COUNT += 1
    if progress:
        progress(ProgressEvent("compile", "compiled", 3, 3))
    params = param_list(named_params)
    return (params, stock) if report_pipeline else params
