"""llmchat's split decode attention for WGSL (``pipelines/wgsl_attention``) on a real Vulkan
driver (lavapipe in CI): TVM's ``batch_decode_paged_kv`` is built, replaced by the split kernels,
compiled to WGSL and run on scattered pages against a float64 numpy reference of paged attention
(output and base-2 log-sum-exp); and the pass in the tiny model's pipeline."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.inference.backends.vulkan_env import need_vulkan

PAGE = 16

CASES = [
    # query heads, kv heads, head_dim, dtype, keys of each sequence
    (4, 2, 16, "float32", [1]),
    (4, 2, 16, "float32", [15, 16, 17]),
    (16, 2, 128, "float16", [1, 33, 517]),  # Qwen2.5-3B's heads, group 8
    (16, 2, 128, "float32", [1030]),
    (32, 8, 128, "float16", [1100]),  # Llama-3-8B's heads, group 4
    (14, 2, 64, "float32", [1030, 16]),  # group 7
    (8, 8, 64, "float16", [100, 2]),
    (8, 4, 64, "float32", [31, 32, 33, 48]),  # group 2
    (8, 1, 64, "float16", [2100]),  # group 8, many chunks
    # the Qwen2.5 shapes at short contexts (v2: one chunk, no merge) and long ones (the merge)
    (14, 2, 64, "float16", [1, 17, 64]),  # Qwen2.5-0.5B
    (14, 2, 64, "float16", [1030]),
    (16, 2, 128, "float16", [17, 64]),  # Qwen2.5-3B
    (16, 2, 128, "float16", [1100]),
]
VARIANTS = ["split-v2", "split-v1"]


@pytest.fixture(scope="module")
def webgpu_target():
    need_vulkan()
    import tvm

    from app.inference.backends import webgpu

    return tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}))


def _tvm_kernel(h_qo, h_kv, d, dtype, target):
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

    return _attention_decode(h_kv, h_qo, d, dtype, False, {}, target, PAGE)


def _build(func, target, tmp_path):
    import tvm

    from app.inference.pipelines.wgsl_attention import DECODE_ATTENTION

    lib = tvm.compile(tvm.IRModule({DECODE_ATTENTION: func}), target=target)
    path = tmp_path / "attention.so"
    lib.export_library(str(path))
    return tvm.runtime.load_module(str(path))


def _reference(q, pages, indptr, values, lens, sm_scale):
    """float64 paged attention: (output [B, H_qo, D], lse base 2 [B, H_qo])."""
    b_n, h_qo, d = q.shape
    h_kv = pages.shape[2]
    group = h_qo // h_kv
    out = np.zeros((b_n, h_qo, d))
    lse = np.zeros((b_n, h_qo))
    for b in range(b_n):
        ids = values[indptr[b] : indptr[b + 1]]
        kv = pages[ids].astype(np.float64)  # [pages, 2, H_kv, PAGE, D]
        keys = kv[:, 0].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, : lens[b]]
        vals = kv[:, 1].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, : lens[b]]
        for h in range(h_qo):
            s = keys[h // group] @ q[b, h].astype(np.float64) * sm_scale
            p = np.exp(s - s.max())
            out[b, h] = p @ vals[h // group] / p.sum()
            lse[b, h] = (s.max() + np.log(p.sum())) / np.log(2)
    return out, lse


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("h_qo", "h_kv", "d", "dtype", "lens"),
    CASES,
    ids=[f"{a}q{b}kv-d{c}-{t}-{'_'.join(map(str, n))}" for a, b, c, t, n in CASES],
)
def test_split_decode_attention_matches_float64_reference(
    webgpu_target, tmp_path, h_qo, h_kv, d, dtype, lens, variant
):
    _check(webgpu_target, tmp_path, h_qo, h_kv, d, dtype, lens, variant)


def _check(webgpu_target, tmp_path, h_qo, h_kv, d, dtype, lens, variant):
    """The split kernels of ``variant`` built for these shapes, run on scattered pages: launches
    (one without a merge up to 128 keys for v2) and output / lse against :func:`_reference`."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines.wgsl_attention import DECODE_ATTENTION, split_decode_attention

    target = webgpu_target
    tvm_func = _tvm_kernel(h_qo, h_kv, d, dtype, target)
    func = split_decode_attention(
        tvm_func,
        int(target.attrs["max_num_threads"]),
        int(target.attrs["max_shared_memory_per_block"]),
        variant,
    )
    assert func is not None, "these shapes should get the split kernel"
    lib = _build(func, target, tmp_path)
    src = lib.imports[0].inspect_source()
    # the split body: a partial kernel and a merge kernel (TVM's is one kernel)
    assert sorted(re.findall(r"fn (batch_decode_paged_kv\w*)\(", src)) == [
        "batch_decode_paged_kv_kernel",
        "batch_decode_paged_kv_kernel_1",
    ]

    dev = webgpu.device(0)
    rng = np.random.default_rng(sum(lens) + h_qo)
    b_n = len(lens)
    n_pages = [-(-n // PAGE) for n in lens]
    nnz = sum(n_pages)
    max_pages = nnz + 3
    pages = rng.standard_normal((max_pages, 2, h_kv, PAGE, d)).astype(dtype)
    values = rng.permutation(max_pages)[:nnz].astype("int32")  # scattered, out of order
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype("int32")
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lens, n_pages, strict=True)], "int32")
    q = (rng.standard_normal((b_n, h_qo, d)) * 2).astype(dtype)
    sm_scale = 1 / np.sqrt(d)
    zeros = np.zeros(b_n, "int32")
    out = tvm.runtime.empty((b_n, h_qo, d), dtype, dev)
    lse = tvm.runtime.empty((b_n, h_qo), "float32", dev)
    t = [tvm.runtime.tensor(a, dev) for a in (q, pages, indptr, values, last, zeros, zeros)]
    before = webgpu.stats(dev.index)["dispatches"]
    lib[DECODE_ATTENTION](*t, out, lse, 0, 1.0, 10000.0, sm_scale)
    dispatches = webgpu.stats(dev.index)["dispatches"] - before
    # v2 runs one chunk and no merge while the page table holds at most 128 keys' pages
    one_chunk = variant.startswith("split-v2") and nnz * PAGE <= 128
    assert dispatches == (1 if one_chunk else 2)

    ref, ref_lse = _reference(q, pages, indptr, values, lens, sm_scale)
    tol = 2e-3 if dtype == "float16" else 2e-5  # float16 output rounding; float32 accumulation
    err = np.abs(out.numpy().astype(np.float64) - ref).max()
    assert err <= tol, f"output off by {err:.2e}"
    lse_err = np.abs(lse.numpy() - ref_lse).max()
    assert lse_err <= (1e-3 if dtype == "float16" else 1e-4), f"lse off by {lse_err:.2e}"


KEY_CASES = [
    # query heads = kv heads, head_dim, dtype, keys of each sequence, variant
    (32, 128, "float16", [3, 100], "split-v2"),  # Llama-2-7B's shape, one chunk (the default: key16)
    (32, 128, "float16", [1000], "split-v2"),  # ... chunks and the merge
    (32, 128, "float16", [3, 100], "split-v2-key8"),
    (32, 128, "float16", [1000], "split-v2-key8"),  # ... chunks and the merge
    (32, 128, "float16", [129, 31], "split-v2-key8-single0"),  # chunks from the first page
    (8, 64, "float32", [15, 16, 17, 300], "split-v2-key8"),
    (4, 16, "float32", [1, 47], "split-v2-key4"),  # 4 threads a key, 64 keys a step
    (8, 64, "float16", [2100], "split-v2-key16-wg64"),
]


@pytest.mark.parametrize(
    ("h", "d", "dtype", "lens", "variant"),
    KEY_CASES,
    ids=[f"{a}h-d{c}-{t}-{'_'.join(map(str, n))}-{v}" for a, c, t, n, v in KEY_CASES],
)
def test_key_parallel_kernel_matches_float64_reference(webgpu_target, tmp_path, h, d, dtype, lens, variant):
    """``split-v2-keyN`` (:mod:`.wgsl_attention_keys`): a KV head with one query head, N threads a
    key and each key slot its own online softmax, combined at the end of the chunk, gives the
    float64 reference's output and lse (one chunk without a merge up to 128 keys; sequences of
    different lengths, so chunks past a sequence's end)."""
    from app.inference.pipelines.wgsl_attention import v2_options
    from app.inference.pipelines.wgsl_attention_keys import key_layout

    shared = int(webgpu_target.attrs["max_shared_memory_per_block"])
    layout = key_layout(h, h, d, PAGE, 256, shared, v2_options(variant))
    assert layout is not None and layout.tpk == v2_options(variant).key_threads
    assert layout.slots * layout.tpk == layout.threads
    _check(webgpu_target, tmp_path, h, h, d, dtype, lens, variant)


HEAD_SPLIT_CASES = [
    # query heads, kv heads, head_dim, dtype, keys of each sequence, variant
    (16, 2, 128, "float16", [17, 64], "split-v2-heads2"),  # Qwen2.5-3B: 8 workgroups of 2 heads
    (16, 2, 128, "float16", [1100], "split-v2-heads2"),  # ... chunks and the merge
    (16, 2, 128, "float16", [17, 1100], "split-v2-heads0"),  # all 8 in one workgroup (before)
    (14, 2, 64, "float32", [300, 16], "split-v2-heads1"),  # 7 heads alone, 64 threads each
    (32, 32, 128, "float16", [3, 100], "split-v2-key0"),  # Llama-2-7B's 32 KV heads, one head each
    (32, 32, 128, "float16", [1000], "split-v2-key0-wg512"),  # ... 16 chunks a head and the merge
]


@pytest.mark.parametrize(
    ("h_qo", "h_kv", "d", "dtype", "lens", "variant"),
    HEAD_SPLIT_CASES,
    ids=[f"{a}q{b}kv-d{c}-{t}-{'_'.join(map(str, n))}-{v}" for a, b, c, t, n, v in HEAD_SPLIT_CASES],
)
def test_v2_query_heads_split_over_workgroups(webgpu_target, tmp_path, h_qo, h_kv, d, dtype, lens, variant):
    """``split-v2-headsN``: a KV head's query heads over several workgroups of N heads each (the
    same keys, fewer products a thread; 0: all in one) give the float64 reference's output and
    lse; the layout says how many workgroups share a KV head."""
    from app.inference.pipelines.wgsl_attention import kv_head_layout, v2_options

    options = v2_options(variant)
    shared = int(webgpu_target.attrs["max_shared_memory_per_block"])
    layout = kv_head_layout(h_qo, h_kv, d, PAGE, 256, shared, options)
    padded = 1 << (h_qo // h_kv - 1).bit_length()
    assert layout is not None and layout.heads == (min(padded, options.max_heads) or padded)
    assert layout.hsplit == padded // layout.heads  # workgroups a KV head
    _check(webgpu_target, tmp_path, h_qo, h_kv, d, dtype, lens, variant)


def _profile_target(profile):
    import tvm

    from app.inference.backends import webgpu

    return tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile=profile))


def test_layout_spreads_qwen_decode_over_many_workgroups():
    """Qwen2.5-3B's shape on the H200 profile: TVM's kernel runs 2 workgroups; the split runs
    (head groups x chunks) of them, within the profile's threads and workgroup memory."""
    from app.inference.pipelines.wgsl_attention import split_layout

    layout = split_layout(16, 2, 128, PAGE, max_threads=256, shared_bytes=49152)
    assert layout is not None and layout.threads <= 256
    assert layout.tile * (128 + 1) * 4 + (layout.heads * 128 + 2 * layout.threads) * 4 <= 49152
    head_groups = 16 // layout.heads
    pages_512 = 512 // PAGE
    chunk_pages = max(layout.min_pages, -(-pages_512 // layout.max_chunks))
    assert head_groups * -(-pages_512 // chunk_pages) >= 128
    # lavapipe's 32 KiB and head_dim 64 fit too; a head_dim over the thread limit does not
    assert split_layout(32, 8, 64, PAGE, max_threads=256, shared_bytes=32768) is not None
    assert split_layout(8, 8, 512, PAGE, max_threads=256, shared_bytes=49152) is None
    assert split_layout(8, 8, 96, PAGE, max_threads=256, shared_bytes=49152) is None


@pytest.mark.parametrize("quantization", ["q4f16_1", "q4f32_1"])
def test_pass_replaces_decode_attention_in_the_tiny_model(quantization):
    """The GPU pipeline's attention passes on a webgpu target swap the tiny model's decode
    attention for the split kernels (its KV cache uses RopeMode.NORMAL), keeping the signature;
    ``LLMCHAT_WGSL_ATTENTION=tvm`` and a module without a NORMAL-RoPE KV cache keep TVM's."""
    import tvm
    from tvm import relax

    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config
    from app.inference.pipelines import gpu
    from app.inference.pipelines.wgsl_attention import DECODE_ATTENTION, split_decode_attention_pass

    target = _profile_target("wgsl-f16-wg32768-t256")
    mod, _ = export_model(preset_config("tiny-llama", quantization), target)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.FuseTIR()])(mod)
        passes = gpu.attention_passes(target)
        # decode, the prompt's (wgsl_prefill_attention) and the merge of its two softmaxes
        assert [p.info.name for p in passes] == [
            "llmchat_wgsl_split_decode_attention",
            "llmchat_wgsl_prefill_attention",
            "llmchat_wgsl_merge_state",
        ]
        new = tvm.transform.Sequential(passes)(mod)
        alone = tvm.IRModule({DECODE_ATTENTION: mod[DECODE_ATTENTION]})
        plain = split_decode_attention_pass(256, 32768)(alone)
    old_f, new_f = mod[DECODE_ATTENTION], new[DECODE_ATTENTION]
    assert [str(p) for p in new_f.params] == [str(p) for p in old_f.params]
    assert str(new_f.attrs["global_symbol"]) == DECODE_ATTENTION
    old_text, new_text = old_f.script(), new_f.script()
    assert 'T.sblock("attn")' in old_text and 'T.sblock("attn")' not in new_text
    assert new_text.count('T.launch_thread("blockIdx.x"') == 2  # the partial and the merge kernels
    assert plain[DECODE_ATTENTION].same_as(mod[DECODE_ATTENTION])  # no NORMAL-RoPE KV cache: kept
    # TVM's merge of the prompt's two partial softmaxes is llmchat's in the model too
    assert new["tir_attention_merge_state"].attrs["llmchat_kernel"] == "wgsl_merge_state"


def test_v2_layout_splits_the_query_heads_of_a_kv_head():
    """v2 on the H200 profile: a workgroup holds 4 query heads of its KV head (Qwen2.5-0.5B: 7,
    padded to 8; 3B: 8; two workgroups a KV head), within the profile's threads and workgroup
    memory; one chunk up to 128 keys, then chunks of at least one tile, at most 32 per (KV head,
    head split) (128 workgroups). Llama-2-7B's 32 KV heads: one head, 128 threads, 4 chunks at
    most; ``tvmmany`` keeps TVM's kernel there; an unknown option is an error."""
    from app.inference.pipelines.wgsl_attention import kv_head_layout, v2_options

    for h_qo, d, tile in ((14, 64, 32), (16, 128, 32)):
        layout = kv_head_layout(h_qo, 2, d, PAGE, max_threads=256, shared_bytes=49152)
        assert layout is not None
        assert (layout.group, layout.heads, layout.hsplit, layout.threads, layout.tile) == (
            h_qo // 2,
            4,
            2,
            256,
            tile,
        )
        assert (2 * layout.tile * (d + 1) + layout.heads * d + layout.threads) * 4 <= 49152
        assert layout.single_pages * PAGE == 128 and layout.max_chunks == 32
    assert kv_head_layout(16, 2, 128, PAGE, max_threads=256, shared_bytes=32768).tile == 16  # lavapipe
    llama = kv_head_layout(32, 32, 128, PAGE, max_threads=256, shared_bytes=49152)
    assert llama is not None and (llama.heads, llama.hsplit, llama.threads, llama.max_chunks) == (
        1,
        1,
        128,
        4,
    )
    assert kv_head_layout(32, 32, 128, PAGE, 256, 49152, v2_options("split-v2-tvmmany")) is None
    assert v2_options("split-v2-heads0-single0-wg256") == v2_options("split-v2-wg256-single0-heads0")
    with pytest.raises(ValueError, match="heads3"):
        v2_options("split-v2-heads3")


def test_key_parallel_kernel_is_the_default_for_one_query_head_a_kv_head():
    """v2 runs Llama-2-7B's shape (32 query heads, 32 KV heads) on the key-parallel kernel with
    :data:`DEFAULT_KEY_THREADS` threads a key (``key0``: v2's own), 8 chunks a KV head at long
    contexts (v2's kernel: 4); grouped shapes (Qwen2.5) and a head_dim below the threads a key
    keep v2's kernel."""
    from app.inference.pipelines.wgsl_attention import DEFAULT_KEY_THREADS, v2_options
    from app.inference.pipelines.wgsl_attention_keys import key_layout

    default = v2_options("split-v2")
    assert default.key_threads == DEFAULT_KEY_THREADS == 16
    llama = key_layout(32, 32, 128, PAGE, 256, 49152, default)
    assert llama is not None and (llama.threads, llama.tpk, llama.slots) == (256, 16, 16)
    assert llama.single_pages * PAGE == 128 and llama.max_chunks == 8  # 256 workgroups at long contexts
    assert key_layout(32, 32, 128, PAGE, 256, 49152, v2_options("split-v2-wg128")).max_chunks == 4
    assert key_layout(32, 32, 128, PAGE, 256, 49152, v2_options("split-v2-key0")) is None
    assert key_layout(16, 2, 128, PAGE, 256, 49152, default) is None  # Qwen2.5-3B: v2
    assert key_layout(4, 4, 8, PAGE, 256, 49152, default) is None  # 8 dimensions, 16 threads a key
    with pytest.raises(ValueError, match="key3"):
        v2_options("split-v2-key3")


def test_attention_variant_switch(monkeypatch):
    """``LLMCHAT_WGSL_ATTENTION``: split-v2 by default, split-v1 for A/B, tvm for TVM's kernel."""
    from app.inference.compile.cache import _kernel_switches
    from app.inference.pipelines import gpu_choices

    monkeypatch.delenv("LLMCHAT_WGSL_ATTENTION", raising=False)
    assert gpu_choices.wgsl_attention_variant() == "split-v2"
    monkeypatch.setenv("LLMCHAT_WGSL_ATTENTION", "split-v1")
    assert gpu_choices.wgsl_attention_variant() == "split-v1"
    assert _kernel_switches()["LLMCHAT_WGSL_ATTENTION"] == "split-v1"  # a library of its own


def test_tvm_switch_keeps_tvm_attention(monkeypatch):
    from app.inference.pipelines import gpu

    def names() -> list[str]:
        return [p.info.name for p in gpu.attention_passes(_profile_target("wgsl-f16-wg32768-t256"))]

    monkeypatch.setenv("LLMCHAT_WGSL_ATTENTION", "tvm")
    monkeypatch.setenv("LLMCHAT_WGSL_PREFILL_ATTENTION", "tvm")
    # TVM's attention kernels; only the merge of two partial softmaxes stays llmchat's (TVM's races)
    assert names() == ["llmchat_wgsl_merge_state"]
    monkeypatch.delenv("LLMCHAT_WGSL_PREFILL_ATTENTION")  # the prompt's kernel has its own switch
    assert names() == ["llmchat_wgsl_prefill_attention", "llmchat_wgsl_merge_state"]


def test_many_kv_heads_keep_tvms_kernel():
    """With 16 or more KV heads (Llama-2-7B: 32) TVM's one-workgroup-per-head kernel was faster on
    the H200 than split-v1: v1 is not used there (v2 is)."""
    from app.inference.pipelines.wgsl_attention import TVM_KERNEL_MIN_KV_HEADS, split_layout

    assert split_layout(32, 32, 128, PAGE, max_threads=256, shared_bytes=49152) is None
    assert (
        split_layout(
            TVM_KERNEL_MIN_KV_HEADS, TVM_KERNEL_MIN_KV_HEADS, 64, PAGE, max_threads=256, shared_bytes=49152
        )
        is None
    )
    assert split_layout(16, 2, 128, PAGE, max_threads=256, shared_bytes=49152) is not None


def _rope_np(x, pos, theta, d):
    """TVM's RoPE of one head's row (float64 reference)."""
    c = np.arange(d)
    freq = pos / theta ** ((c * 2 % d) / d)
    partner = np.where(c < d // 2, -x[(c + d // 2) % d], x[(c + d // 2) % d])
    return np.cos(freq) * x + np.sin(freq) * partner


FUSED_CASES = [
    # query heads, kv heads, head_dim, keys (the new token included), variant
    (16, 2, 128, 17, "split-v2"),  # Qwen2.5-3B, one chunk
    (14, 2, 64, 300, "split-v2"),  # Qwen2.5-0.5B, chunks and the merge
    (32, 32, 128, 33, "split-v2-key0"),  # Llama-2-7B on v2's kernel
    (32, 32, 128, 33, "split-v2"),  # ... keys in parallel (the default: 16 threads a key)
    (32, 32, 128, 300, "split-v2"),  # ... chunks and the merge
    (32, 32, 128, 33, "split-v2-key8"),  # ... 8 threads a key
    (32, 32, 128, 1, "split-v2-key8"),  # ... the new key alone
    (32, 32, 128, 300, "split-v2-key8"),  # ... chunks and the merge
    (32, 32, 128, 129, "split-v2-key8-single0-wg512"),  # ... the new key alone in the last chunk
]


@pytest.mark.parametrize(
    ("h_qo", "h_kv", "d", "n", "variant"),
    FUSED_CASES,
    ids=[f"{a}q{b}kv-d{c}-{n}-{v}" for a, b, c, n, v in FUSED_CASES],
)
def test_fused_rope_append_reads_the_recorded_projection(webgpu_target, tmp_path, h_qo, h_kv, d, n, variant):
    """The fused v2 kernel (one sequence): q, k and v of the new token come from the q/k/v
    projection recorded through the add-on (not from ``Q`` or the page slot, which hold junk),
    RoPE is applied as TVM's split-rotary does, the new key and value land in their page slot,
    and the output and lse match a float64 reference; with two sequences the same library reads
    ``Q`` and the pages as they are (TVM's split-rotary and append ran)."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines.cuda_rope_append import FUSED_ATTR
    from app.inference.pipelines.wgsl_attention import DECODE_ATTENTION, split_decode_attention

    target, dtype, theta = webgpu_target, "float16", 10000.0
    tvm_func = _tvm_kernel(h_qo, h_kv, d, dtype, target).with_attr(FUSED_ATTR, True)
    func = split_decode_attention(
        tvm_func,
        int(target.attrs["max_num_threads"]),
        int(target.attrs["max_shared_memory_per_block"]),
        variant,
    )
    lib = _build(func, target, tmp_path)
    dev = webgpu.device(0)
    rng = np.random.default_rng(n + h_qo)
    n_pages = -(-n // PAGE)
    max_pages = n_pages + 2
    pages = rng.standard_normal((max_pages, 2, h_kv, PAGE, d)).astype(dtype)
    values = rng.permutation(max_pages)[:n_pages].astype("int32")
    indptr = np.array([0, n_pages], "int32")
    last = np.array([n - (n_pages - 1) * PAGE], "int32")
    pos = n - 1
    qkv = rng.standard_normal((1, h_qo + 2 * h_kv, d)).astype(dtype)
    junk_q = np.full((1, h_qo, d), 7.0, dtype)  # what Q holds: split-rotary did not run
    slot, off = values[pos // PAGE], pos % PAGE
    pages[slot, :, :, off, :] = 9.0  # the append did not run either
    sm_scale = 1 / np.sqrt(d)
    q_pos = np.array([pos], "int32")
    t_pages = tvm.runtime.tensor(pages, dev)
    t = [tvm.runtime.tensor(a, dev) for a in (junk_q,)]
    rest = [tvm.runtime.tensor(a, dev) for a in (indptr, values, last, np.zeros(1, "int32"), q_pos)]
    t_qkv = tvm.runtime.tensor(qkv, dev)
    out = tvm.runtime.empty((1, h_qo, d), dtype, dev)
    lse = tvm.runtime.empty((1, h_qo), "float32", dev)
    tvm.get_global_func("llmchat.webgpu.record_qkv")(t_qkv)
    lib[DECODE_ATTENTION](t[0], t_pages, *rest, out, lse, 0, 1.0, theta, sm_scale)

    x = qkv.astype(np.float64)[0]
    q = np.stack([_rope_np(x[h], pos, theta, d) for h in range(h_qo)]).astype(dtype)
    k_new = np.stack([_rope_np(x[h_qo + h], pos, theta, d) for h in range(h_kv)]).astype(dtype)
    v_new = qkv[0, h_qo + h_kv :]
    got_pages = t_pages.numpy()
    # the slot holds the rotated key (float16 rounding of float32 sin/cos) and the value exactly
    assert np.abs(got_pages[slot, 0, :, off, :].astype(np.float64) - k_new).max() <= 4e-3
    assert np.array_equal(got_pages[slot, 1, :, off, :], v_new)
    other = np.ones(pages.shape, bool)
    other[slot, :, :, off, :] = False
    assert np.array_equal(got_pages[other], pages[other])  # nothing else written
    ref_pages = pages.copy()
    ref_pages[slot, 0, :, off, :] = k_new
    ref_pages[slot, 1, :, off, :] = v_new
    ref, ref_lse = _reference(q[None], ref_pages, indptr, values, [n], sm_scale)
    assert np.abs(out.numpy().astype(np.float64) - ref).max() <= 5e-3
    assert np.abs(lse.numpy() - ref_lse).max() <= 2e-3

    # two sequences: Q and the pages as they are, the recorded projection not read
    q2 = rng.standard_normal((2, h_qo, d)).astype(dtype)
    indptr2 = np.array([0, n_pages, n_pages], "int32")
    lens2 = [n, 0]
    last2 = np.array([last[0], 0], "int32")
    zeros2 = np.zeros(2, "int32")
    out2 = tvm.runtime.empty((2, h_qo, d), dtype, dev)
    lse2 = tvm.runtime.empty((2, h_qo), "float32", dev)
    args2 = [tvm.runtime.tensor(a, dev) for a in (q2, pages, indptr2, values, last2, zeros2, zeros2)]
    lib[DECODE_ATTENTION](*args2, out2, lse2, 0, 1.0, theta, sm_scale)
    ref2, _ = _reference(q2[:1], pages, indptr2[:2], values, lens2[:1], sm_scale)
    assert np.abs(out2.numpy()[:1].astype(np.float64) - ref2).max() <= 5e-3  # values near 9: half a step
