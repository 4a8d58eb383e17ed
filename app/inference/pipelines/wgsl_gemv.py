"""The decode GEMV rule for WGSL (webgpu/Vulkan): llmchat's ``DecodeGEMV`` in one of a family of
thread layouts, the same family ``benchmarks/wgsl_gemv_sweep.py`` times on a GPU.

Each variant is named by its layout: threads per row (``t``), threads per workgroup (``b``),
bytes per weight load (``l``: 4 = ``u32``, 8 = ``vec2<u32>``, 16 = ``vec4<u32>``), loads in flight
(``u``), the grid kept at ``mb`` workgroups or more (``mb``), the staged activation vector's
chunks padded against bank conflicts or not (``nopad``), only rows of K values or more (``kK``).
Whether the rows are summed by subgroup shuffles or through workgroup memory is not the
variant's choice but the adapter profile's: a ``-sg32`` profile (one fixed subgroup size) lowers
the same schedule to subgroup shuffles (:mod:`.wgsl_subgroups`).

**Since session 10** the product's first rule is ``q4-auto``: llmchat's hand-scheduled kernel
(:mod:`.wgsl_q4_gemv`; int8 activations and ``dot4I8Packed``) for every q4f16_1 GEMV with K up to
8191 whose rows it tiles. In the model on the H200 (``LLMCHAT_WEBGPU_PROFILE=1``,
``benchmarks/results/h200-2026-12-02-s10-q4``), µs per GEMV against the rules below: Llama-2-7B
gate_up 45.8 -> 30.4, qkv 31.4 -> 21.6, o 20.9 -> 17.6; Qwen2.5-3B gate_up 26.4 -> 23.3, qkv 16.4
-> 13.7, o 16.2 -> 13.8. **Since session 12** ``q4-auto`` also takes the down projections (K up
to 16,384) and picks its rows per set by the workgroups they give (``MIN_WORKGROUPS`` in
:mod:`.wgsl_q4_gemv`): 7B down 51.9 -> 25.9 µs, o 17.5 -> 15.6, 3B down 34.3 -> 20.5. The rules below
keep what it does not tile or what exceeds an adapter's workgroup memory.

Before that, the product compiled the two rules after ``q4-auto``, chosen by the sweep on the H200's
Vulkan driver (``benchmarks/results/h200-2026-12-02-gemv-sweep``, each GEMV alone, 200 launches per
submission, µs per launch, the ~6 µs launch floor included): 32 rows per workgroup of 8 threads with
16-byte loads, and for the 11008-wide down projection, which those do not tile, 8 threads per row
with ``u32`` loads and the vector unpadded (44 KiB of workgroup memory) where dlight's GEMV took it
before — only for rows of 8192 or more and 4096 output rows or more (narrower rows that 16-byte
loads do not tile, such as Qwen2.5-0.5B's 896, keep dlight's GEMV). Llama-2-7B shape, each GEMV
alone, against the layout before (``t32-b256-l16-u4``, down: dlight): qkv 29.59 -> 24.86, o 13.65 ->
13.97, gate_up 45.24 -> 40.45, down 50.02 -> 47.28, lm head 61.94 -> 52.84 µs.

The whole model on the H200 (``benchmarks/results/h200-2026-12-02-wgsl-gemv-model``, decode tok/s):
Llama-2-7B 153.4 (layout before) -> 161.6 (the 16-byte rule alone) -> 164.2 (with the u32 down
rule); Qwen2.5-3B 220.6 (before) -> 219.4 (16-byte rule alone) but 199.8 with the u32 rule on its
11008 -> 2048 down projection (64 workgroups of 32 rows): hence the 4096-row floor. Not measured on
an AMD GPU. ``LLMCHAT_WGSL_GEMV=NAME[,NAME...]`` picks variants instead (the first that fits a GEMV
takes it; what none fits goes to dlight's GEMV): ``t32-b256-l16-u4`` is the layout before. The
switch is part of the library's cache key.
"""

from __future__ import annotations

import os
from typing import Any

from app.errors import LlmchatError

#: the switch naming the variants to use
ENV = "LLMCHAT_WGSL_GEMV"
#: the rules the product compiles by default, in order (the module's docstring has the figures)
DEFAULT = ("q4-auto", "t8-b256-l16-u4-mb128", "t8-b256-l4-u4-mb128-nopad-k8192-n4096")
#: the rules before session 10's hand-scheduled kernel (for A/B runs: ``LLMCHAT_WGSL_GEMV=`` these)
DECODE_GEMV_ONLY = ("t8-b256-l16-u4-mb128", "t8-b256-l4-u4-mb128-nopad-k8192-n4096")
#: ``DecodeGEMV()``'s layout on a 256-thread profile: the default before the sweep
PREVIOUS = "t32-b256-l16-u4"
#: WGSL vectors have at most 4 lanes (the vector's staging stores)
STAGE_LANES = 4
#: workgroup memory for the staged activation vector: 44 KiB, for the 11008-wide down projection
#: in fp32 on a 48 KiB profile (a profile with less gets dlight's GEMV for it)
SHARED_VECTOR_BYTES = 45056

VARIANTS: dict[str, dict[str, Any]] = {
    "t32-b256-l16-u4": {"t": 32, "b": 256, "l": 16, "u": 4},
    "t32-b256-l16-u1": {"t": 32, "b": 256, "l": 16, "u": 1},
    "t32-b256-l16-u2": {"t": 32, "b": 256, "l": 16, "u": 2},
    "t32-b256-l16-u8": {"t": 32, "b": 256, "l": 16, "u": 8},
    "t32-b128-l16-u4": {"t": 32, "b": 128, "l": 16, "u": 4},
    "t16-b256-l16-u4": {"t": 16, "b": 256, "l": 16, "u": 4},
    "t16-b128-l16-u4": {"t": 16, "b": 128, "l": 16, "u": 4},
    "t8-b256-l16-u4": {"t": 8, "b": 256, "l": 16, "u": 4},
    "t64-b256-l16-u4": {"t": 64, "b": 256, "l": 16, "u": 4},
    "t128-b256-l16-u4": {"t": 128, "b": 256, "l": 16, "u": 4},
    "t32-b256-l4-u4": {"t": 32, "b": 256, "l": 4, "u": 4},
    "t32-b256-l4-u8": {"t": 32, "b": 256, "l": 4, "u": 8},
    "t32-b256-l4-u4-nopad": {"t": 32, "b": 256, "l": 4, "u": 4, "pad": False},
    "t8-b256-l16-u4-mb128": {"t": 8, "b": 256, "l": 16, "u": 4, "mb": 128},
    "t16-b256-l8-u4-mb128": {"t": 16, "b": 256, "l": 8, "u": 4, "mb": 128},
    "t32-b256-l8-u4": {"t": 32, "b": 256, "l": 8, "u": 4},
    "t8-b256-l4-u4-mb128-nopad": {"t": 8, "b": 256, "l": 4, "u": 4, "mb": 128, "pad": False},
    "t32-b128-l4-u4-mb128-nopad": {"t": 32, "b": 128, "l": 4, "u": 4, "mb": 128, "pad": False},
    "t32-b256-l4-u8-nopad": {"t": 32, "b": 256, "l": 4, "u": 8, "pad": False},
    "t16-b256-l8-u4-mb128-nopad": {"t": 16, "b": 256, "l": 8, "u": 4, "mb": 128, "pad": False},
    "t32-b256-l16-u4-nopad": {"t": 32, "b": 256, "l": 16, "u": 4, "pad": False},
    # the one above for rows of 8192 or more only (the 7B down projection, where it was measured)
    "t8-b256-l4-u4-mb128-nopad-k8192": {
        "t": 8,
        "b": 256,
        "l": 4,
        "u": 4,
        "mb": 128,
        "pad": False,
        "kmin": 8192,
    },
    # and only for 4096 output rows or more (the 7B down projection gained, 3B's 2048 rows lost)
    "t8-b256-l4-u4-mb128-nopad-k8192-n4096": {
        "t": 8,
        "b": 256,
        "l": 4,
        "u": 4,
        "mb": 128,
        "pad": False,
        "kmin": 8192,
        "nmin": 4096,
    },
}


#: layouts of the hand-scheduled kernel (:mod:`.wgsl_q4_gemv`) that ``wgsl_gemv_sweep.py`` times:
#: rows per set, lanes per set, threads; ``unpack2x16float`` decode, TVM's fp32 decode, int8 dot4
Q4_SWEEP = (
    "q4-r2-l32-t256",
    "q4-r4-l32-t256",
    "q4-r2-l64-t256",
    "q4-r4-l64-t256",
    "q4-r2-l128-t256",
    "q4-r4-l128-t256",
    "q4-r4-l32-t128",
    "q4-r1-l32-t256",
    "q4-r4-l32-t256-f32",
    "q4-r2-l64-t256-f32",
    "q4-r1-l32-t256-dp4a",
    "q4-r2-l32-t256-dp4a",
    "q4-r4-l32-t256-dp4a",
    "q4-r2-l64-t256-dp4a",
    "q4-r4-l64-t256-dp4a",
    "q4-r4-l128-t256-dp4a",
    "q4-r2-l16-t256-dp4a",
    "q4-r8-l32-t256-dp4a",
    # fewer rows per workgroup (more workgroups for narrow layers), and more for the fp32 decode
    "q4-r1-l32-t64-dp4a",
    "q4-r2-l32-t64-dp4a",
    "q4-r4-l32-t64-dp4a",
    "q4-r2-l32-t128-dp4a",
    "q4-r4-l32-t128-dp4a",
    "q4-r2-l16-t128-dp4a",
    "q4-r4-l32-t64-f32",
    "q4-r4-l32-t128-f32",
    "q4-r8-l32-t256-f32",
    "q4-r4-l16-t256-f32",
    "q4-r2-l32-t256-f32",
    # two int8 levels (the rounding's remainder as the second): float16-level error
    "q4-r4-l32-t256-dp4a2",
    "q4-r2-l16-t256-dp4a2",
    "q4-r8-l32-t256-dp4a2",
    "q4-r4-l32-t128-dp4a2",
    "q4-r4-l32-t64-dp4a2",
    "q4-r2-l32-t64-dp4a2",
    "q4-r2-l32-t256-dp4a2",
)


def rule(name: str) -> Any:
    """``DecodeGEMV`` laid out as variant ``name``, or for a ``q4-...`` name llmchat's
    hand-scheduled kernel (:mod:`.wgsl_q4_gemv`) in that layout (raises LlmchatError for an
    unknown name)."""
    from app.inference.pipelines import wgsl_q4_gemv
    from app.inference.pipelines.gpu_gemv import DecodeGEMV

    if name == "q4-auto":
        return wgsl_q4_gemv.WgslQ4Gemv(None)
    parsed = wgsl_q4_gemv.parse_rule(name)
    if parsed is not None:
        layout, min_rows, max_k = parsed
        return wgsl_q4_gemv.WgslQ4Gemv(layout, min_rows=min_rows, max_reduction=max_k)
    p = VARIANTS.get(name)
    if p is None:
        raise LlmchatError(
            f"{name!r} is not one of llmchat's WGSL GEMV variants.",
            f"unset {ENV}, or set it to one or more of: {', '.join(VARIANTS)} (comma-separated), "
            "or a layout of llmchat's own kernel such as q4-r4-l32-t256 (q4-rROWS-lLANES-tTHREADS, "
            "-f32 or -dp4a for the other decodes)",
        )
    return DecodeGEMV(
        load_bytes=p["l"],
        max_threads_per_row=p["t"],
        max_block_threads=p["b"],
        unroll_steps=p["u"],
        min_blocks=p.get("mb", 512),
        shared_vector_bytes=SHARED_VECTOR_BYTES,
        pad_shared=p.get("pad", True),
        stage_vector_lanes=STAGE_LANES,
        pad_words=min(32, p["l"] * 2),  # one chunk's values (a 16-byte load: 32), then 4 words of padding
        min_reduction=p.get("kmin", 0),
        min_rows=p.get("nmin", 0),
    )


def chosen() -> list[str]:
    """The variants in use, in order: those ``LLMCHAT_WGSL_GEMV`` names, else :data:`DEFAULT`."""
    text = os.environ.get(ENV, "").strip().lower()
    return [n.strip() for n in text.split(",") if n.strip()] or list(DEFAULT)


def rules() -> list[Any]:
    """The GEMV rules for a WGSL target (raises LlmchatError for an unknown variant name)."""
    return [rule(n) for n in chosen()]
