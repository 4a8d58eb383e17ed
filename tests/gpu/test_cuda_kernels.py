"""llmchat's CUDA kernels (app/inference/pipelines/cuda_kernels.cu) on the GPU against numpy in
float64, on edge shapes: odd sizes, one row, the largest layers of the supported models, 1 to 8,192
keys, page and tile boundaries, prompts over cached pages. Each family is built into one module (one
nvcc run) by the harness of tests/gpu/kernels.py, whose CPU side runs in ``make test``
(test_harness_on_cpu.py); on a GPU machine without TVM's compiler they come from the prebuilt cache
(tests/gpu/prebuilt.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest

from tests.gpu import kernels

pytestmark = pytest.mark.gpu

#: decode attention: (query heads, kv heads, head dim) of Llama-2-7B, Llama-3-8B, Qwen2.5-3B,
#: Qwen2.5-0.5B and a tiny model
ATTENTION_SHAPES = [(32, 32, 128), (32, 8, 128), (16, 2, 128), (14, 2, 64), (4, 2, 64)]
#: key counts: one, page boundaries (16), a chunk's worth, long contexts up to 8,192
KEY_BATCHES = [[1], [15], [16], [17], [255], [256], [257], [1000], [4096], [8192], [1, 17, 300, 2048]]


def matmul_cases() -> list[kernels.Case]:
    """Decode GEMVs of every epilogue and layout, the SiLU-gated gate_up, prompt GEMMs."""
    return [
        kernels.gemv_case(32, 4, "f32"),  # one group, one row per warp
        kernels.gemv_case(96, 12, "f16"),  # 3 groups (odd), 12 rows
        kernels.gemv_case(896, 1152, "bias"),  # Qwen2.5-0.5B q/k/v with its bias
        kernels.gemv_case(896, 896, "res"),  # Qwen2.5-0.5B o_proj + residual
        kernels.gemv_case(4096, 12288, "f16"),  # Llama-2-7B q/k/v: split-K 4
        kernels.gemv_case(11008, 4096, "res"),  # Llama-2-7B down: several steps per warp, 8 warps
        kernels.gemv_case(2048, 22016, "f16"),  # split 2
        kernels.gemv_case(4096, 32000, "f32"),  # Llama-2-7B lm_head (float32 logits)
        kernels.gemv_case(896, 151936, "f32"),  # Qwen2.5 lm_head: the most rows
        kernels.gemv_case(4096, 28672, "f16"),  # Llama-3-8B gate_up: the largest decode layer
        kernels.silu_gate_case(256, 512),
        kernels.silu_gate_case(896, 4864),  # Qwen2.5-0.5B
        kernels.silu_gate_case(4096, 11008),  # Llama-2-7B
        kernels.gemm_case(96, 64, "f16", rows=(1, 63, 64, 65, 200)),  # one q4 group per step
        kernels.gemm_case(2048, 2560, "bias", rows=(1, 64, 130)),  # narrow: 64-row tiles
        # wide: 128-row tiles; from 1,921 rows (512 blocks) the mma.sync kernel, a partial last tile
        kernels.gemm_case(4096, 4096, "res", rows=(1, 127, 128, 129, 512, 1920, 1921)),
        kernels.gemm_case(896, 151936, "f32", rows=(3, 130)),  # float32 out, mma.sync at every length
        kernels.gemm_case(11008, 4096, "res", rows=(7, 300, 2000)),  # Llama-2-7B down
        kernels.gemm_case(3584, 4608, "bias", rows=(5, 1800)),  # Qwen2.5-7B q/k/v: bias, mma.sync
        kernels.gemm_case(1024, 8192, "f16", rows=(896, 897, 1000)),  # mma.sync from 897 rows
    ]


def small_op_cases() -> list[kernels.Case]:
    return [
        *(kernels.argmax_case(v) for v in (1, 7, 300, 1024, 1025, 32000, 128256, 151936)),
        *(
            kernels.rms_norm_case(k, eps)
            for k, eps in (
                (8, 1e-5),
                (64, 1e-5),
                (576, 1e-5),
                (896, 1e-6),
                (2048, 1e-6),
                (4096, 1e-5),
                (8192, 1e-5),
            )
        ),
    ]


def decode_attention_cases(max_cluster: int) -> list[kernels.Case]:
    return [
        kernels.decode_attention_case(h_q, h_kv, d, KEY_BATCHES, max_cluster)
        for h_q, h_kv, d in ATTENTION_SHAPES
    ]


def prefill_cases() -> list[kernels.Case]:
    batches = [
        ([1], [1], True),
        ([63], [63], True),
        ([64], [64], True),
        ([65], [65], True),
        ([130], [130], True),
        ([5, 64, 100], [5, 64, 100], True),
        ([70], [220], True),
        ([33], [33], False),
        ([512], [512], True),
    ]
    return [
        kernels.prefill_attention_case(h_q, h_kv, d, batches)
        for h_q, h_kv, d in [(32, 32, 128), (14, 2, 64), (4, 2, 16)]
    ]


#: prompt attention over the cached pages: (query heads, kv heads, head dim) of Llama-2-7B (group
#: 1), Llama-3-8B (4), Qwen2.5-3B (8), Qwen2.5-0.5B (7, head dim 64)
PAGED_PREFILL_SHAPES = [(32, 32, 128), (32, 8, 128), (16, 2, 128), (14, 2, 64)]


def paged_prefill_cases() -> list[kernels.Case]:
    """A prompt chunk after the first attending to the keys already cached (TVM calls it with
    causal 0; causal runs check the offsets of TVM's mask too): one query row, odd row counts,
    1 to 8,192 cached keys, partial last pages, several sequences (one without keys, one
    without queries); the kernel's key tiles loaded through registers (the engine's default) and
    by cp.async (``LLMCHAT_CUDA_PAGED_PREFILL=async``)."""
    batches = [
        ([1], [1], False),
        ([1], [8192], False),
        ([7], [17], False),
        ([63], [16], False),
        ([65], [4095], False),
        ([130], [2048], False),
        ([200], [6001], False),
        ([3, 64, 129], [1, 300, 4097], False),
        ([4, 9], [0, 40], False),
        ([0, 9], [33, 40], False),
        ([33], [100], True),
        ([128], [128], True),
    ]
    return [
        kernels.paged_prefill_attention_case(h_q, h_kv, d, batches, pipelined)
        for pipelined in (False, True)
        for h_q, h_kv, d in PAGED_PREFILL_SHAPES
    ]


#: GQA-4 on sm_90 (cuda_attention.py): blocks of the 4 query heads of a kv head from a threshold of
#: keys per sequence (pages x 16 >= threshold x sequences), one head per block in clusters below.
#: With a threshold of 256 keys (16 pages) both kernels take short runs. Clusters: 1, 17 and 240
#: keys (15 pages), [1, 17, 300] (22 pages < 3 x 16), and 17 sequences of 300 (17 x 32 heads x 16
#: chunks for Llama-3-8B's shape, 17 x 16 heads x 32 chunks for the others: more states than the
#: scratch area's 8,192 holds). The long-context kernel: 241 keys (16 pages), 256, 257, 1,000,
#: 4,096, [1, 17, 300, 2,048] (150 pages), [300, 2,048].
GQA_KEY_BATCHES = [[1], [17], [240], [241], [256], [257], [1000], [4096]]
GQA_KEY_BATCHES += [[1, 17, 300], [1, 17, 300, 2048], [300, 2048], [300] * 17]


def gqa_decode_cases(max_cluster: int) -> list[kernels.Case]:
    """The decode kernels of grouped-query shapes on sm_90, chosen by the keys (a threshold of
    256: llmchat's tensor-core kernel for Llama-3-8B's and Qwen2.5-3B's head dim 128, the blocks
    of 4 heads for 16 query heads over 4 kv heads of dim 64) or forced (``groups``, ``mma``: every
    key count; ``mma`` also for Qwen2.5-7B's 7 query heads per kv head, padded to 8)."""
    return [
        *(
            kernels.decode_attention_case(h_q, h_kv, d, GQA_KEY_BATCHES, max_cluster, gqa_min_keys=256)
            for h_q, h_kv, d in [(32, 8, 128), (16, 4, 64), (16, 2, 128)]
        ),
        kernels.decode_attention_case(32, 8, 128, KEY_BATCHES, max_cluster, gqa="groups"),
        *(
            kernels.decode_attention_case(h_q, h_kv, d, KEY_BATCHES, max_cluster, gqa="mma")
            for h_q, h_kv, d in [(32, 8, 128), (28, 4, 128)]
        ),
    ]


def unsplit_batch_cases() -> list[kernels.Case]:
    """More (sequence, head, chunk) states than the scratch area holds: every sequence unsplit."""
    batch = [[20 + i for i in range(40)]]  # 40 sequences x 32 heads x 8 chunks > 8,192 rows
    return [kernels.decode_attention_case(32, 32, 128, batch)]


def kernel_groups(facts: dict) -> dict[str, Callable[[], list[kernels.Case]]]:
    """The suite's kernel libraries (one module each) that run on a GPU of these ``facts``
    (tests/gpu/prebuilt.target_facts): what ``make gpu-cache`` compiles."""
    groups = {
        "small_ops": small_op_cases,
        "decode_global": partial(decode_attention_cases, 0),
        "decode_unsplit": unsplit_batch_cases,
    }
    if facts["matmul_kernels"]:
        groups["matmul"] = matmul_cases
    if facts["max_cluster"]:
        groups["decode_cluster"] = partial(decode_attention_cases, facts["max_cluster"])
        groups["decode_gqa"] = partial(gqa_decode_cases, facts["max_cluster"])
    if facts["prompt_attention"]:
        groups["prefill"] = prefill_cases
        groups["prefill_paged"] = paged_prefill_cases
    return groups


def _check(group: str, cuda, tmp_path) -> None:
    cases = kernel_groups(cuda.facts)[group]()
    lib = cuda.kernels(group, cases, tmp_path)
    failures = kernels.run_all(lib, cases, cuda.device)
    assert not failures, "\n".join(failures)


def test_matmul_kernels(cuda, tmp_path):
    if not cuda.facts["matmul_kernels"]:
        pytest.skip(f"llmchat's matmul kernels are not used on {cuda.arch}")
    _check("matmul", cuda, tmp_path)


def test_argmax_and_rms_norm_kernels(cuda, tmp_path):
    _check("small_ops", cuda, tmp_path)


def test_decode_attention_merged_through_global_memory(cuda, tmp_path):
    """The path before sm_90 (and for batches too large for a cluster's scratch-free merge)."""
    _check("decode_global", cuda, tmp_path)


def test_decode_attention_merged_in_a_cluster(cuda, tmp_path):
    if not cuda.facts["max_cluster"]:
        pytest.skip(f"no thread-block clusters on {cuda.arch} (sm_90 and later)")
    _check("decode_cluster", cuda, tmp_path)


def test_decode_attention_of_gqa_groups(cuda, tmp_path):
    """GQA-4 on sm_90: blocks of 4 query heads (global-memory merge) from a number of keys on,
    one head per block in clusters below; both sides of the host code's choice."""
    if not cuda.facts["max_cluster"]:
        pytest.skip(f"no thread-block clusters on {cuda.arch} (sm_90 and later)")
    _check("decode_gqa", cuda, tmp_path)


def test_decode_attention_batch_too_large_to_split(cuda, tmp_path):
    """More (sequence, head, chunk) states than the scratch area holds: every sequence unsplit."""
    _check("decode_unsplit", cuda, tmp_path)


def test_prompt_attention_kernel(cuda, tmp_path):
    if not cuda.facts["prompt_attention"]:
        pytest.skip(f"llmchat's prompt attention needs sm_80, this GPU is {cuda.arch}")
    _check("prefill", cuda, tmp_path)


def test_prompt_attention_over_the_cached_pages(cuda, tmp_path):
    if not cuda.facts["prompt_attention"]:
        pytest.skip(f"llmchat's prompt attention needs sm_80, this GPU is {cuda.arch}")
    _check("prefill_paged", cuda, tmp_path)
