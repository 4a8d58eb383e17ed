// llmchat's hand-written CUDA kernels: decode GEMV (1), decode attention (2), greedy argmax (3),
// prompt GEMM (4), prompt attention (5) and decode RMSNorm (6); see cuda_gemv.py,
// cuda_attention.py, cuda_argmax.py, cuda_gemm.py, cuda_rms_norm.py for the TIR functions that
// launch them.
//
// 1. Batch-1 dequantizing GEMV for MLC's q4f16_1 layout.
//
// out[n] = epilogue(sum_k x[k] * (nibble(W[n, k]) - 7) * scale[n, k / 32])
//
// A warp computes R output rows; lane l handles the groups l, l + 32, ... of 32 values, so each
// step a warp reads 512 contiguous bytes of every row (one 16-byte load per lane and row). The
// lane's 32 activations are loaded once per step and reused for all R rows. Dequantization uses
// half2 bit tricks: (w & 0x000F000F) | 0x64006400 is the half2 (1024 + n_a, 1024 + n_b) and one
// HSUB2 gives (n - 7) exactly; the odd nibbles are masked in place (1024 + 16 n) and one HFMA2 by
// 1/16 gives them, so a word needs one shift. The kernel is bound by instruction issue as much as
// by DRAM on an H200 (the same loads without the math run 1.4x faster), hence the fewest
// instructions per value: a group's 32 products are summed in one half2 (16 per half; the logits
// are checked against TVM's fp32-accumulating pipeline on every benchmark run), then scaled and
// accumulated in fp32.
// Weights are streamed past L1 (ld.global.nc.L1::no_allocate) so the activations stay cached.
#include <cuda_fp16.h>
#include <stdint.h>

namespace llmchat {

// The fused q/k/v projection of the current layer, recorded by the matmul that computes it (RECORD)
// for the decode attention, which then applies RoPE and appends the new key and value itself when
// one token is decoded (FUSED, see section 2 and cuda_rope_append.py).
__device__ const half* fused_qkv_src = nullptr;

__device__ __forceinline__ uint4 ld_stream_v4(const uint32_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Loads before this point are issued before loads after it: ptxas does not move memory accesses
// across griddepcontrol.wait (sm_90), which returns at once in a kernel launched the ordinary way (as
// all of llmchat's are: it waits only for a programmatic-dependent launch's predecessor).
__device__ __forceinline__ void load_order_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// (a & mask) | bits in one LOP3
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

__device__ __forceinline__ half2 as_half2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }

// 8 activations (x0..x7 as four half2 words) -> pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7)
__device__ __forceinline__ void pair_up(uint4 v, half2 p[4]) {
  p[0] = as_half2(__byte_perm(v.x, v.z, 0x5410));
  p[1] = as_half2(__byte_perm(v.x, v.z, 0x7632));
  p[2] = as_half2(__byte_perm(v.y, v.w, 0x5410));
  p[3] = as_half2(__byte_perm(v.y, v.w, 0x7632));
}

// acc + the 8 products of one packed word with its paired activations (values k, k + 4 per half)
__device__ __forceinline__ half2 dot8(uint32_t w, const half2 p[4], half2 acc) {
  const uint32_t lo = 0x000F000Fu, hi = 0x00F000F0u, magic = 0x64006400u;
  const half2 offset = as_half2(0x64076407u);     // 1024 + 7
  const half2 sixteenth = as_half2(0x2C002C00u);  // 1 / 16
  const half2 bias = as_half2(0xD470D470u);       // -(64 + 7): (1024 + 16 n) / 16 - 71 = n - 7
  const uint32_t w8 = w >> 8;
  acc = __hfma2(__hsub2(as_half2(and_or(w, lo, magic)), offset), p[0], acc);
  acc = __hfma2(__hfma2(as_half2(and_or(w, hi, magic)), sixteenth, bias), p[1], acc);
  acc = __hfma2(__hsub2(as_half2(and_or(w8, lo, magic)), offset), p[2], acc);
  acc = __hfma2(__hfma2(as_half2(and_or(w8, hi, magic)), sixteenth, bias), p[3], acc);
  return acc;
}

// MODE: 0 = float32 output; 1 = float16 output; 2 = float16 output plus a float16 residual
// (out = residual + half(sum)); 3 = SiLU-gated pairs: rows n and n + N/2 (gate and up of a fused
// gate_up projection) give out[n] = silu(half(sum_n)) * half(sum_n+N/2), N/2 outputs, in the half
// arithmetic of TVM's split-silu-multiply kernel that it replaces. BIAS: add a float16 bias before
// the cast (out = half(sum + b)).
// SPLIT warps of a block share R rows, each taking every SPLIT-th step of the row (more loads in
// flight for layers with few rows and long ones); their sums meet in shared memory.
// RECORD: store `out` in fused_qkv_src (the layer's fused q/k/v projection).
template <int K, int N, int R, int SPLIT, int MODE, bool BIAS, typename OutT, bool RECORD = false>
__device__ __forceinline__ void q4f16_gemv(const half* __restrict__ x, const uint32_t* __restrict__ w,
                                           const half* __restrict__ scale,
                                           const half* __restrict__ bias,
                                           const half* __restrict__ residual,
                                           OutT* __restrict__ out) {
  static_assert(K % 32 == 0, "K must be a multiple of the group size");
  if constexpr (RECORD) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) fused_qkv_src = out;
  }
  constexpr int GROUPS = K / 32;
  constexpr int WORDS = K / 8;
  const int lane = threadIdx.x;
  const int part = threadIdx.y % SPLIT;
  static_assert(MODE != 3 || (R % 2 == 0 && N % 2 == 0 && !BIAS), "SiLU pairs: R/2 gate and R/2 up rows");
  // the warp's rows: R consecutive ones, or (MODE 3) R/2 gate rows and the R/2 up rows N/2 further
  const int row0 = (blockIdx.x * (blockDim.y / SPLIT) + threadIdx.y / SPLIT) * (MODE == 3 ? R / 2 : R);
  auto row_of = [&](int r) { return MODE == 3 && r >= R / 2 ? N / 2 + row0 + r - R / 2 : row0 + r; };
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  // The first step's weights and scales (DRAM) are issued before its activations (L2 or L1), behind
  // a barrier ptxas keeps, so that the two latencies overlap; for K = 4096 under split-K that is the
  // warp's only step. H200, weights rotating through 32 layers, output bit-identical: Llama-2-7B
  // qkv 10.30 -> 8.93 us, gate_up 15.78 -> 13.74, lm_head 21.49 -> 18.79 (the same loop without
  // the barrier, or with a compiler-only one, measured no change: ptxas hoists the activations).
  const int g0 = lane + 32 * part;
  uint4 q0[R];
  half s0[R];
  if (g0 < GROUPS) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      q0[r] = ld_stream_v4(w + (size_t)row_of(r) * WORDS + g0 * 4);
      s0[r] = scale[(size_t)row_of(r) * GROUPS + g0];
    }
  }
  load_order_barrier();
  auto step = [&](int g, const uint4* q, const half* s) {
    const uint4* xv = reinterpret_cast<const uint4*>(x + g * 32);
    half2 p[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pair_up(__ldg(xv + j), p[j]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      half2 h = __float2half2_rn(0.f);
      h = dot8(q[r].w, p[3], dot8(q[r].z, p[2], dot8(q[r].y, p[1], dot8(q[r].x, p[0], h))));
      const float2 f = __half22float2(h);
      acc[r] = fmaf(__half2float(s[r]), f.x + f.y, acc[r]);
    }
  };
  if (g0 < GROUPS) step(g0, q0, s0);
#pragma unroll
  for (int g = g0 + 32 * SPLIT; g < GROUPS; g += 32 * SPLIT) {
    uint4 q[R];
    half s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      q[r] = ld_stream_v4(w + (size_t)row_of(r) * WORDS + g * 4);
      s[r] = scale[(size_t)row_of(r) * GROUPS + g];
    }
    step(g, q, s);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  }
  if constexpr (SPLIT > 1) {
    __shared__ float partial[32][R];  // [warp][row]; at most 32 warps per block
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) partial[threadIdx.y][r] = acc[r];
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = 0.f;
#pragma unroll
      for (int i = 0; i < SPLIT; ++i) v += partial[threadIdx.y + i][r];
      acc[r] = v;
    }
  }
  if constexpr (MODE == 3) {
    if (lane < R / 2) {
      float gate = acc[0], up = acc[R / 2];
#pragma unroll
      for (int r = 1; r < R / 2; ++r) {
        gate = (lane == r) ? acc[r] : gate;
        up = (lane == r) ? acc[R / 2 + r] : up;
      }
      const half g = __float2half_rn(gate), one = __float2half_rn(1.f), zero = __float2half_rn(0.f);
      out[row0 + lane] = __hmul(__hmul(g, __hdiv(one, __hadd(one, hexp(__hsub(zero, g))))), __float2half_rn(up));
    }
  } else if (lane < R) {
    float v = acc[0];
#pragma unroll
    for (int r = 1; r < R; ++r) v = (lane == r) ? acc[r] : v;
    const int n = row0 + lane;
    if constexpr (MODE == 0) {
      out[n] = v;
    } else {
      if constexpr (BIAS) v += __half2float(bias[n]);
      half h = __float2half_rn(v);
      if constexpr (MODE == 2) h = __hadd(residual[n], h);
      out[n] = h;
    }
  }
}

}  // namespace llmchat

// ------------------------------------------------------------------------------------------------
// 2. Decode attention over the paged KV cache (TVM's layout: pages[page, 2 (K, V), kv head, slot, dim]),
// split along the sequence: grid (NC chunks, query heads / GH, batch). Every block handles GH query
// heads (sharing one kv head) over one chunk of the keys (online softmax in the log2 domain, as TVM's
// kernel: scores are scaled by sm_scale * log2(e)). The chunks' partial states are merged
//  - CLUSTER (sm_90): by the NC blocks of a thread-block cluster through distributed shared memory,
//    each block finishing every NC-th output value (H200, 32 layers in a CUDA graph, 266 keys:
//    Llama-2-7B 6.55 -> 5.32 us, Qwen2.5-3B 7.31 -> 4.76 us against the global-memory merge;
//    cuda_attention.py picks NC and GH = 1 so that long contexts keep enough blocks);
//  - otherwise: by the last block of a (sequence, head block) to finish, from a static scratch area
//    (also on sm_90 for the blocks of GH = 4 query heads sharing a kv head that cuda_attention.py
//    launches for long sequences of GQA-4 models: each key read once per kv head, not once per head).
// ------------------------------------------------------------------------------------------------
#include <cooperative_groups.h>

namespace llmchat {

constexpr int ATTN_SCRATCH_ROWS = 8192;           // (sequence, query head, chunk) partial states
constexpr int ATTN_SCRATCH_FLOATS = 8192 * 128;   // their output vectors
__device__ float attn_partial_o[ATTN_SCRATCH_FLOATS];
__device__ float2 attn_partial_md[ATTN_SCRATCH_ROWS];
__device__ unsigned int attn_chunks_done[ATTN_SCRATCH_ROWS];

__device__ __forceinline__ void merge_state(float& m, float& d, float* o, float m2, float d2, const float* o2) {
  const float mm = fmaxf(m, m2);
  const float a = exp2f(m - mm), b = exp2f(m2 - mm);
  d = d * a + d2 * b;
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = o[j] * a + o2[j] * b;
  m = mm;
}

// FUSED decode (below): rows 0 .. G - 1 of `dst` get query heads head0 .. head0 + G - 1 of the fused
// q/k/v projection, row G the key of kv head kvh, each rotated as TVM's split-rotary kernel does
// (float32, rounded to half); the block's `threads` threads share the work, a dimension's angle
// computed once for its G + 1 rows.
template <int H_QO, int D, int G>
__device__ __forceinline__ void rope_rows(half (*dst)[D], const half* qkv, int head0, int kvh, float pos,
                                          float rope_theta, int threads) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int dim = tid; dim < D; dim += threads) {
    const float freq = pos / powf(rope_theta, (float)((dim * 2) % D) / (float)D);
    float sn, cs;
    sincosf(freq, &sn, &cs);
#pragma unroll
    for (int row = 0; row <= G; ++row) {
      const half* x = qkv + (size_t)(row < G ? head0 + row : H_QO + kvh) * D;
      const float rot = dim < D / 2 ? -__half2float(x[dim + D / 2]) : __half2float(x[dim - D / 2]);
      dst[row][dim] = __float2half_rn(cs * __half2float(x[dim]) + sn * rot);
    }
  }
}

// The state of GH heads over the WARPS warps of a block (each warp's in sm_o / sm_md): for head g,
// dimension dim, the running maximum mm, the denominator dd and the output value oo.
template <int GH, int D, int WARPS>
__device__ __forceinline__ void warps_state(const float (*sm_o)[GH][D], const float (*sm_md)[GH][2], int g, int dim,
                                            float& mm, float& dd, float& oo) {
  mm = sm_md[0][g][0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) mm = fmaxf(mm, sm_md[w][g][0]);
  dd = 0.f;
  oo = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const float a = exp2f(sm_md[w][g][0] - mm);
    dd += sm_md[w][g][1] * a;
    oo += sm_o[w][g][dim] * a;
  }
}

// The global-memory merge of a split decode: every block has written its GH heads' states for chunk
// blockIdx.x to the scratch area; the last of the NC blocks of (sequence b, head block `counter`) to
// finish combines the NC states of each head into out and lse (and resets the counter).
template <int H_QO, int D, int NC, int GH, int WARPS>
__device__ __forceinline__ void merge_chunks(int b, int head0, int counter, half* __restrict__ out,
                                             float* __restrict__ lse) {
  const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(&attn_chunks_done[counter], 1u) == NC - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // The merge's loads are issued together (a trip to L2 per batch of outputs, not one per head and
  // per 8 chunks): the first batch of each thread's partial outputs while warp g reads head g's
  // (m, d) pairs; a batch holds at most 64 values in registers.
  constexpr int PER = (GH * D + WARPS * 32 - 1) / (WARPS * 32);  // outputs per thread
  constexpr int RB = PER * NC <= 64 ? PER : (64 / NC > 0 ? 64 / NC : 1), NB = (PER + RB - 1) / RB;
  float part[RB][NC];
  auto fetch = [&](int batch) {
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const int idx = tid + (batch * RB + r) * WARPS * 32;
      const size_t row0 = ((size_t)b * H_QO + head0 + idx / D) * NC;
#pragma unroll
      for (int i = 0; i < NC; ++i) part[r][i] = idx < GH * D ? __ldcg(&attn_partial_o[(row0 + i) * D + idx % D]) : 0.f;
    }
  };
  fetch(0);
  // per head: the chunks' weights exp2(m_i - M) and the total denominator, then the outputs
  __shared__ float weight[GH][NC];
  __shared__ float total[GH];
  __shared__ float top[GH];
  for (int g = warp; g < GH; g += WARPS) {
    const size_t row0 = ((size_t)b * H_QO + head0 + g) * NC;
    float mi = -5e4f, di = 0.f;
    if (lane < NC) {
      const float2 md = __ldcg(&attn_partial_md[row0 + lane]);
      mi = md.x;
      di = md.y;
    }
    float mm = mi;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, off));
    const float a = lane < NC ? exp2f(mi - mm) : 0.f;
    float dd = di * a;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dd += __shfl_xor_sync(0xffffffffu, dd, off);
    if (lane < NC) weight[g][lane] = a;
    if (lane == 0) { total[g] = dd; top[g] = mm; }
  }
  __syncthreads();
#pragma unroll
  for (int batch = 0; batch < NB; ++batch) {
    if (batch > 0) fetch(batch);
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const int idx = tid + (batch * RB + r) * WARPS * 32;
      if (idx >= GH * D) continue;
      const int g = idx / D, dim = idx % D;
      const int head = head0 + g;
      float oo = 0.f;
#pragma unroll
      for (int i = 0; i < NC; ++i) oo = fmaf(part[r][i], weight[g][i], oo);
      const float dd = total[g];
      out[((size_t)b * H_QO + head) * D + dim] = __float2half_rn(dd > 0.f ? oo / dd : 0.f);
      if (dim == 0) lse[(size_t)b * H_QO + head] = dd > 0.f ? top[g] + log2f(dd) : -5e4f;
    }
  }
  if (tid == 0) attn_chunks_done[counter] = 0u;
}

// FUSED: for one decoded token (batch == 1) TVM's KV cache skips its split-rotary and append
// kernels (cuda_rope_append.py); the kernel reads q, k and v of the token from the layer's fused
// projection (fused_qkv_src), applies RoPE as TVM's split-rotary kernel does (float32, rounded to
// half; each block rotates its query heads and the key once, one dim per thread, in shared memory),
// uses the new key and value for the last position and writes them to their page slot.
template <int H_QO, int H_KV, int D, int PAGE, int NC, int GH, int WARPS, bool CLUSTER, bool FUSED = false>
__device__ __forceinline__ void decode_attention(const half* __restrict__ q, const half* __restrict__ pages,
                                                 const int* __restrict__ indptr,
                                                 const int* __restrict__ values,
                                                 const int* __restrict__ last_len, half* __restrict__ out,
                                                 float* __restrict__ lse, float sm_scale, int batch,
                                                 int rotary_mode, const int* __restrict__ q_pos = nullptr,
                                                 float rope_scale = 1.f, float rope_theta = 1e4f) {
  constexpr int GROUP = H_QO / H_KV;  // query heads per kv head
  constexpr int BLOCKS_PER_SEQ = H_QO / GH;
  static_assert(GROUP % GH == 0, "a block's query heads share one kv head");
  constexpr int TPK = D / 8;          // threads per key (8 dims each)
  constexpr int KPW = 32 / TPK;       // keys per warp and step
  static_assert(D % 8 == 0 && TPK <= 32 && (TPK & (TPK - 1)) == 0, "head_dim must be 8 * 2^k <= 256");
  static_assert(NC >= 1 && NC <= 32, "the merge gives each chunk one lane of a warp");
  static_assert(!CLUSTER || NC <= 16, "at most 16 blocks in a cluster (more than 8: non-portable)");
  const float scale = sm_scale * 1.4426950408889634f;  // log2(e)
  const int c = blockIdx.x, hb = blockIdx.y, b = blockIdx.z;
  const int head0 = hb * GH, kvh = head0 / GROUP;
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int sub = lane % TPK, slot = lane / TPK;
  if (rotary_mode != 0) __trap();  // RoPE is applied before the cache (RopeMode.NORMAL) only
  // a batch too large for the scratch area is not split: block 0 takes the whole sequence
  const bool split = NC > 1 && (CLUSTER || (batch * H_QO * NC <= ATTN_SCRATCH_ROWS &&
                                            (size_t)batch * H_QO * NC * D <= (size_t)ATTN_SCRATCH_FLOATS &&
                                            batch * BLOCKS_PER_SEQ <= ATTN_SCRATCH_ROWS));
  if (!split && c > 0) return;
  const int pb = indptr[b], pe = indptr[b + 1];
  const int len = (pe != pb) ? (pe - pb - 1) * PAGE + last_len[b] : 0;
  int chunk = split ? (len + NC - 1) / NC : len;
  chunk = chunk < 16 ? 16 : chunk;
  const int start = c * chunk;
  const int end = min(len, start + chunk);

  // steps per batch: their page lookups and K/V loads are all in flight together (registers: 4
  // steps for GH <= 2 query heads per block, 2 for the 4 heads of a GQA group: cuda_attention.py)
  constexpr int UK = GH <= 2 ? 4 : 2;
  static_assert(GH <= 4, "more query heads per block need fewer steps per batch");
  constexpr int BATCH = UK * WARPS * KPW;  // keys per batch of the block
  uint4 kr[UK], vr[UK];
  auto load_batch = [&](int base0) {
    int page[UK];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const int k = base0 + u * WARPS * KPW + slot;
      page[u] = k < end ? values[pb + k / PAGE] : 0;
    }
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const int k = base0 + u * WARPS * KPW + slot;
      if (k < end) {
        const half* kp = pages + (((size_t)page[u] * 2 * H_KV + kvh) * PAGE + k % PAGE) * D + sub * 8;
        kr[u] = *reinterpret_cast<const uint4*>(kp);
        vr[u] = *reinterpret_cast<const uint4*>(kp + (size_t)H_KV * PAGE * D);
      } else {
        kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  // the first batch's loads go out before the query (and FUSED's RoPE and barrier): their latency
  // overlaps that work
  const int first = start + warp * KPW;
  if (first < end) load_batch(first);

  // one decoded token with FUSED: q, k, v from the fused projection, RoPE here, k and v appended here
  const bool fused = FUSED && batch == 1;
  uint4 k_new = make_uint4(0u, 0u, 0u, 0u), v_new = k_new;
  __shared__ __align__(16) half rope_qk[FUSED ? GH + 1 : 1][FUSED ? D : 8];  // rotated q heads, then k
  if constexpr (FUSED) {
    if (fused) {
      const half* qkv = fused_qkv_src;
      rope_rows<H_QO, D, GH>(rope_qk, qkv, head0, kvh, (float)q_pos[0] * rope_scale, rope_theta, WARPS * 32);
      __syncthreads();
      k_new = *reinterpret_cast<const uint4*>(&rope_qk[GH][sub * 8]);
      v_new = *reinterpret_cast<const uint4*>(qkv + (size_t)(H_QO + H_KV + kvh) * D + sub * 8);
      if (c == 0 && head0 % GROUP == 0 && warp == 0 && slot == 0 && len > 0) {
        const int p = len - 1;
        half* kp = const_cast<half*>(pages) + (((size_t)values[pb + p / PAGE] * 2 * H_KV + kvh) * PAGE + p % PAGE) * D + sub * 8;
        *reinterpret_cast<uint4*>(kp) = k_new;
        *reinterpret_cast<uint4*>(kp + (size_t)H_KV * PAGE * D) = v_new;
      }
    }
  }
  float qv[GH][8], m[GH], d[GH], o[GH][8];
#pragma unroll
  for (int g = 0; g < GH; ++g) {
    const uint4 raw = FUSED && fused
        ? *reinterpret_cast<const uint4*>(&rope_qk[FUSED ? g : 0][sub * 8])
        : *reinterpret_cast<const uint4*>(q + ((size_t)b * H_QO + head0 + g) * D + sub * 8);
    const half2* h = reinterpret_cast<const half2*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      qv[g][2 * j] = f.x * scale;
      qv[g][2 * j + 1] = f.y * scale;
    }
    m[g] = -5e4f;
    d[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) o[g][j] = 0.f;
  }
  for (int base0 = first; base0 < end; base0 += BATCH) {
    if constexpr (FUSED) {
      if (fused) {
#pragma unroll
        for (int u = 0; u < UK; ++u) {
          const int k = base0 + u * WARPS * KPW + slot;
          if (k == len - 1 && k < end) {  // the new token (the block with c == 0 writes its page slot)
            kr[u] = k_new;
            vr[u] = v_new;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      if (base0 + u * WARPS * KPW >= end) break;  // the same for every lane of the warp
      const bool valid = base0 + u * WARPS * KPW + slot < end;
      float kf[8], vf[8];
      const half2* kh = reinterpret_cast<const half2*>(&kr[u]);
      const half2* vh = reinterpret_cast<const half2*>(&vr[u]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 a = __half22float2(kh[j]), v = __half22float2(vh[j]);
        kf[2 * j] = a.x; kf[2 * j + 1] = a.y; vf[2 * j] = v.x; vf[2 * j + 1] = v.y;
      }
#pragma unroll
      for (int g = 0; g < GH; ++g) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(qv[g][j], kf[j], s);
#pragma unroll
        for (int off = TPK / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (!valid) continue;
        const float mm = fmaxf(m[g], s);
        const float a = exp2f(m[g] - mm), p = exp2f(s - mm);
        d[g] = d[g] * a + p;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[g][j] = fmaf(p, vf[j], o[g][j] * a);
        m[g] = mm;
      }
    }
    if (base0 + BATCH < end) load_batch(base0 + BATCH);
  }
  // combine the key slots of a warp, then the warps
#pragma unroll
  for (int g = 0; g < GH; ++g) {
#pragma unroll
    for (int off = TPK; off < 32; off <<= 1) {
      float o2[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) o2[j] = __shfl_xor_sync(0xffffffffu, o[g][j], off);
      const float m2 = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float d2 = __shfl_xor_sync(0xffffffffu, d[g], off);
      merge_state(m[g], d[g], o[g], m2, d2, o2);
    }
  }
  __shared__ float sm_o[WARPS][GH][D];
  __shared__ float sm_md[WARPS][GH][2];
  if (slot == 0) {
#pragma unroll
    for (int g = 0; g < GH; ++g) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm_o[warp][g][sub * 8 + j] = o[g][j];
      if (sub == 0) { sm_md[warp][g][0] = m[g]; sm_md[warp][g][1] = d[g]; }
    }
  }
  __shared__ float blk_o[CLUSTER ? GH : 1][CLUSTER ? D : 1];  // the block's state, read by its cluster
  __shared__ float blk_md[CLUSTER ? GH : 1][2];
  __syncthreads();
  const int tid = warp * 32 + lane;
  for (int idx = tid; idx < GH * D; idx += WARPS * 32) {
    const int g = idx / D, dim = idx % D;
    float mm, dd, oo;
    warps_state<GH, D, WARPS>(sm_o, sm_md, g, dim, mm, dd, oo);
    const int head = head0 + g;
    if constexpr (CLUSTER) {
      blk_o[g][dim] = oo;
      if (dim == 0) { blk_md[g][0] = mm; blk_md[g][1] = dd; }
    } else if (!split) {
      out[((size_t)b * H_QO + head) * D + dim] = __float2half_rn(dd > 0.f ? oo / dd : 0.f);
      if (dim == 0) lse[(size_t)b * H_QO + head] = dd > 0.f ? mm + log2f(dd) : -5e4f;
    } else {
      const size_t row = ((size_t)b * H_QO + head) * NC + c;
      attn_partial_o[row * D + dim] = oo;
      if (dim == 0) attn_partial_md[row] = make_float2(mm, dd);
    }
  }
  if constexpr (CLUSTER) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    // block c finishes outputs c, c + NC, ... of its GH heads from the NC blocks' states
    for (int idx = c + NC * tid; idx < GH * D; idx += NC * WARPS * 32) {
      const int g = idx / D, dim = idx % D;
      float mr[NC], dr[NC], mm = -5e4f;
#pragma unroll
      for (int r = 0; r < NC; ++r) {
        const float* md = cluster.map_shared_rank(&blk_md[g][0], r);
        mr[r] = md[0];
        dr[r] = md[1];
        mm = fmaxf(mm, mr[r]);
      }
      float dd = 0.f, oo = 0.f;
#pragma unroll
      for (int r = 0; r < NC; ++r) {
        const float a = exp2f(mr[r] - mm);
        dd += dr[r] * a;
        oo += cluster.map_shared_rank(&blk_o[g][0], r)[dim] * a;
      }
      const int head = head0 + g;
      out[((size_t)b * H_QO + head) * D + dim] = __float2half_rn(dd > 0.f ? oo / dd : 0.f);
      if (dim == 0) lse[(size_t)b * H_QO + head] = dd > 0.f ? mm + log2f(dd) : -5e4f;
    }
    cluster.sync();  // the other blocks' shared memory stays until every block has read it
#else
    __trap();  // clusters need sm_90; cuda_attention.py asks for them only there
#endif
  } else if (split) {
    merge_chunks<H_QO, D, NC, GH, WARPS>(b, head0, b * BLOCKS_PER_SEQ + hb, out, lse);
  }
}

}  // namespace llmchat

// ------------------------------------------------------------------------------------------------
// 3. Greedy decoding on the device: the index of the largest logit (the lowest index on ties; NaN
//    never wins), one block of 1024 threads.
// ------------------------------------------------------------------------------------------------
namespace llmchat {

__device__ __forceinline__ void keep_better(float& best, int& idx, float v, int i) {
  if (v > best || (v == best && i < idx)) {
    best = v;
    idx = i;
  }
}

template <int V>
__device__ __forceinline__ void argmax_f32(const float* __restrict__ x, int* __restrict__ out) {
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += blockDim.x) keep_better(best, idx, x[i], i);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, off);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
    keep_better(best, idx, ob, oi);
  }
  __shared__ float warp_best[32];
  __shared__ int warp_idx[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_idx[warp] = idx;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    best = lane < warps ? warp_best[lane] : -INFINITY;
    idx = lane < warps ? warp_idx[lane] : 0x7fffffff;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
      keep_better(best, idx, ob, oi);
    }
    if (lane == 0) out[0] = idx == 0x7fffffff ? 0 : idx;
  }
}

}  // namespace llmchat

// ------------------------------------------------------------------------------------------------
// 4. Prefill: q4f16_1 dequantizing GEMM on tensor cores (WMMA, fp16 x fp16 -> fp32).
//    out[m, n] = epilogue(sum_k x[m, k] * half((nibble - 7) * scale)) for M prompt tokens.
//    Block tile BM (128 or 64) tokens x 64 output features, 4 warps of BM/2 x 32 (each weight
//    value decoded once serves BM tokens; 64 for layers with few output features, where 128 would
//    leave most multiprocessors idle). Each step covers BK values of k (2 q4 groups when K allows, else 1):
//    the weight tile is decoded into shared memory once per block and step (8 values per 16-byte
//    store), and the next step's global loads are issued into registers before this step's MMAs
//    so that their latency overlaps the math.
// ------------------------------------------------------------------------------------------------
#include <mma.h>

namespace llmchat {

// RECORD: store `out` in fused_qkv_src (a prompt chunk's fused q/k/v projection: a one-token chunk
// takes the decode attention). WN: warps along the outputs, 2 (64 outputs, 128 threads a block) or 4
// (128 outputs, 256 threads: each activation tile staged in shared memory serves twice the outputs;
// cuda_gemm.py takes it with 128-row tiles). The accumulation order is the same for both.
template <int K, int N, int BM, int MODE, bool BIAS, typename OutT, bool RECORD = false, int WN = 2>
__device__ __forceinline__ void q4f16_gemm(const half* __restrict__ x, const uint32_t* __restrict__ w,
                                           const half* __restrict__ scale,
                                           const half* __restrict__ bias,
                                           const half* __restrict__ residual,
                                           OutT* __restrict__ out, int M) {
  using namespace nvcuda;
  if constexpr (RECORD) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) fused_qkv_src = out;
  }
  static_assert(WN == 2 || WN == 4, "2 or 4 warps along the outputs");
  constexpr int THREADS = 64 * WN, BN = 32 * WN;
  static_assert(K % 32 == 0 && N % BN == 0, "tiles: K by 32, N by 32 x WN");
  static_assert(BM == 64 || BM == 128, "block rows: 64 or 128");
  constexpr int SG = (K % 64 == 0) ? 2 : 1;  // q4 groups per step
  constexpr int FM = BM / 32;                // 16-row fragments per warp
  constexpr int BK = 32 * SG, LD = BK + 8;
  constexpr int WORDS = K / 8, GROUPS = K / 32, STEPS = K / BK;
  constexpr int XC = BM * BK / 8 / THREADS;  // 16-byte activation chunks per thread and step
  static_assert(XC >= 1, "every thread loads activations");
  constexpr int WW = 2 * SG;                 // weight words per thread and step (half a row's)
  constexpr int PASSES = WN == 2 ? 1 : 2;    // the epilogue's passes over the block's rows (shared memory)
  constexpr int TILE_BYTES = (BM + BN) * LD * 2, C_BYTES = BM / PASSES * (BN + 4) * 4;
  __shared__ __align__(128) unsigned char smem[TILE_BYTES > C_BYTES ? TILE_BYTES : C_BYTES];
  half(*xs)[LD] = reinterpret_cast<half(*)[LD]>(smem);
  half(*ws)[LD] = reinterpret_cast<half(*)[LD]>(smem + BM * LD * 2);
  float(*cs)[BN + 4] = reinterpret_cast<float(*)[BN + 4]>(smem);  // reused after the k loop
  const int tid = threadIdx.x;  // THREADS threads
  const int warp = tid / 32;
  const int wm = warp / WN, wn = warp % WN;  // 2 x WN warps, BM/2 x 32 each
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  const int wr = tid / 2, whalf = tid % 2;  // weight row of this thread, and which half of it

  uint4 xr[XC];
  uint32_t wq[WW];
  half wsc;  // the scale of this thread's group (its words never straddle two)
  auto load = [&](int step) {
#pragma unroll
    for (int c = 0; c < XC; ++c) {
      const int chunk = tid + c * THREADS;
      const int r = chunk / (BK / 8), part = chunk % (BK / 8);
      xr[c] = make_uint4(0u, 0u, 0u, 0u);
      if (m0 + r < M) xr[c] = *reinterpret_cast<const uint4*>(x + (size_t)(m0 + r) * K + step * BK + part * 8);
    }
    const uint32_t* row = w + (size_t)(n0 + wr) * WORDS + step * BK / 8 + whalf * WW;
    if constexpr (WW == 4) {
      const uint4 q = *reinterpret_cast<const uint4*>(row);
      wq[0] = q.x; wq[1] = q.y; wq[2] = q.z; wq[3] = q.w;
    } else {
      const uint2 q = *reinterpret_cast<const uint2*>(row);
      wq[0] = q.x; wq[1] = q.y;
    }
    wsc = scale[(size_t)(n0 + wr) * GROUPS + (step * BK + whalf * WW * 8) / 32];
  };
  auto stage = [&]() {
#pragma unroll
    for (int c = 0; c < XC; ++c) {
      const int chunk = tid + c * THREADS;
      const int r = chunk / (BK / 8), part = chunk % (BK / 8);
      *reinterpret_cast<uint4*>(&xs[r][part * 8]) = xr[c];
    }
    const half2 offset = as_half2(0x64076407u);
    const half2 s2 = __half2half2(wsc);
#pragma unroll
    for (int i = 0; i < WW; ++i) {
      uint32_t v[4];  // (value j, value j + 4) of the word, decoded and scaled
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        half2 h = __hmul2(__hsub2(as_half2(and_or(wq[i] >> (4 * j), 0x000F000Fu, 0x64006400u)), offset), s2);
        v[j] = *reinterpret_cast<uint32_t*>(&h);
      }
      const uint4 vals = make_uint4(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410),
                                    __byte_perm(v[0], v[1], 0x7632), __byte_perm(v[2], v[3], 0x7632));
      *reinterpret_cast<uint4*>(&ws[wr][(whalf * WW + i) * 8]) = vals;
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][2];
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  load(0);
  for (int step = 0; step < STEPS; ++step) {
    stage();
    __syncthreads();
    if (step + 1 < STEPS) load(step + 1);  // in flight during the MMAs below
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a[FM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> bf[2];
#pragma unroll
      for (int i = 0; i < FM; ++i) wmma::load_matrix_sync(a[i], &xs[wm * (BM / 2) + i * 16][kk], LD);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(bf[j], &ws[wn * 32 + j * 16][kk], LD);
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], bf[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    if (pass > 0) __syncthreads();  // the pass before has read cs
    if (PASSES == 1 || wm == pass) {
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          wmma::store_matrix_sync(&cs[wm * (BM / 2) - pass * (BM / PASSES) + i * 16][wn * 32 + j * 16], acc[i][j],
                                  BN + 4, wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = tid; idx < BM / PASSES * BN; idx += THREADS) {
      const int r = pass * (BM / PASSES) + idx / BN, c = idx % BN;
      if (m0 + r >= M) continue;
      const size_t o = (size_t)(m0 + r) * N + n0 + c;
      float v = cs[r - pass * (BM / PASSES)][c];
      if constexpr (MODE == 0) {
        out[o] = v;
      } else {
        if constexpr (BIAS) v += __half2float(bias[n0 + c]);
        half h = __float2half_rn(v);
        if constexpr (MODE == 2) h = __hadd(residual[o], h);
        out[o] = h;
      }
    }
  }
}

}  // namespace llmchat

// ------------------------------------------------------------------------------------------------
// 5. Prompt attention, FlashAttention-2 style on tensor cores (mma.sync m16n8k16, fp16 inputs, fp32
//    accumulators): a block takes 64 query rows of one head (a warp 16 of them, its queries kept in
//    registers as A fragments), streams the visible keys through shared memory 64 at a time, keeps
//    the softmax state (log2 domain, as TVM's kernels) and the output in registers. Grid: (query
//    tiles of all sequences, H_QO). Queries: TVM's ragged layout (q [rows, H_QO, D], sequences
//    delimited by q_indptr). The keys, by a key source (RaggedKeys, PagedKeys):
//    - prefill_attention: the chunk's own keys (k and v [rows, H_KV, D], delimited by kv_indptr), in
//      place of TVM's batch_prefill_ragged_kv;
//    - prefill_paged_attention: the keys already in TVM's paged KV cache (pages [page, 2 (K, V),
//      H_KV, PAGE, D]; sequence b's pages are page_values[page_indptr[b] .. page_indptr[b + 1]), all
//      full but its last, which holds last_len[b] keys), in place of TVM's batch_prefill_paged_kv:
//      a prompt chunk after the first attends to them (TVM merges the two results by their LSE).
//    Both use TVM's mask: with `causal`, row r of a sequence's q_len rows sees its first
//    kv_len - q_len + r + 1 keys, else all kv_len.
// ------------------------------------------------------------------------------------------------
namespace llmchat {

__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t pack_halves(half lo, half hi) {
  half2 h = __halves2half2(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 16 bytes global -> shared without registers (cp.async, sm_80), committed and waited for in groups
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Keys and values of TVM's ragged layout: sequence b's are rows kv_indptr[b] .. kv_indptr[b + 1].
template <int H_KV, int D>
struct RaggedKeys {
  const half* __restrict__ k;
  const half* __restrict__ v;
  const int* __restrict__ indptr;
  int start = 0, len = 0;
  __device__ __forceinline__ void select(int b) {
    start = indptr[b];
    len = indptr[b + 1] - start;
  }
  // key r (0 <= r < len) of kv head kvh: its row of K and of V
  __device__ __forceinline__ const half* key(int r, int kvh) const { return k + ((size_t)(start + r) * H_KV + kvh) * D; }
  __device__ __forceinline__ const half* value(int r, int kvh) const { return v + ((size_t)(start + r) * H_KV + kvh) * D; }
};

// Keys and values in TVM's paged KV cache (the layout of batch_prefill_paged_kv without sliding
// window): key r of sequence b is slot r % PAGE of page page_values[page_indptr[b] + r / PAGE]; the
// sequence holds (pages - 1) * PAGE + last_len[b] keys, none when it has no page.
template <int H_KV, int D, int PAGE>
struct PagedKeys {
  const half* __restrict__ pages;
  const int* __restrict__ page_indptr;
  const int* __restrict__ page_values;
  const int* __restrict__ last_len;
  int first = 0, len = 0;
  __device__ __forceinline__ void select(int b) {
    first = page_indptr[b];
    const int n = page_indptr[b + 1] - first;
    len = n > 0 ? (n - 1) * PAGE + last_len[b] : 0;
  }
  __device__ __forceinline__ const half* key(int r, int kvh) const {
    const size_t page = (size_t)page_values[first + r / PAGE];
    return pages + ((page * 2 * H_KV + kvh) * PAGE + r % PAGE) * D;  // [page, 0 (K), kvh, slot, :]
  }
  __device__ __forceinline__ const half* value(int r, int kvh) const {
    return key(r, kvh) + (size_t)H_KV * PAGE * D;  // [page, 1 (V), kvh, slot, :]
  }
};

// ASYNC: the key tiles are copied with cp.async, each behind the work on the tile before it (V of tile
// t while its scores are computed, K of tile t + 1 during its softmax and P.V); otherwise every tile
// is loaded through registers, then computed.
template <int H_QO, int H_KV, int D, bool ASYNC, typename Keys>
__device__ __forceinline__ void prefill_attention_tiles(const half* __restrict__ q, const int* __restrict__ q_indptr,
                                                        Keys keys, half* __restrict__ out, float* __restrict__ lse,
                                                        int batch, int causal, int rotary_mode, float sm_scale) {
  constexpr int BQ = 64, BK = 64, GROUP = H_QO / H_KV, LD = D + 8;  // rows padded: no bank conflicts
  constexpr int VEC = D / 8;                                          // 16-byte pieces per row
  static_assert(D % 16 == 0 && D <= 128, "head_dim must be a multiple of 16, at most 128 (shared memory)");
  __shared__ __align__(16) half ks[BK][LD];
  __shared__ __align__(16) half vs[BK][LD];
  if (rotary_mode != 0) __trap();  // RoPE is applied before attention (RopeMode.NORMAL) only
  const int h = blockIdx.y, kvh = h / GROUP;
  const int warp = threadIdx.y, lane = threadIdx.x, tid = warp * 32 + lane;
  // this block's (sequence, query tile)
  int t = blockIdx.x, b = 0, q_start = 0, q_len = 0;
  for (; b < batch; ++b) {
    q_start = q_indptr[b];
    q_len = q_indptr[b + 1] - q_start;
    const int tiles = (q_len + BQ - 1) / BQ;
    if (t < tiles) break;
    t -= tiles;
  }
  if (b >= batch) return;
  keys.select(b);
  const int kv_len = keys.len;
  const int row0 = t * BQ;
  const int g = lane >> 2, tq = lane & 3;
  const int r_lo = row0 + warp * 16 + g, r_hi = r_lo + 8;  // the two query rows of this thread
  // queries -> registers (A fragments), staged through ks
  for (int i = tid; i < BQ * VEC; i += 128) {
    const int r = i / VEC, c = (i % VEC) * 8, qr = row0 + r;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (qr < q_len) val = *reinterpret_cast<const uint4*>(q + ((size_t)(q_start + qr) * H_QO + h) * D + c);
    *reinterpret_cast<uint4*>(&ks[r][c]) = val;
  }
  __syncthreads();
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int r = warp * 16 + g, c = kk * 16 + 2 * tq;
    qa[kk][0] = *reinterpret_cast<const uint32_t*>(&ks[r][c]);
    qa[kk][1] = *reinterpret_cast<const uint32_t*>(&ks[r + 8][c]);
    qa[kk][2] = *reinterpret_cast<const uint32_t*>(&ks[r][c + 8]);
    qa[kk][3] = *reinterpret_cast<const uint32_t*>(&ks[r + 8][c + 8]);
  }
  __syncthreads();
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;  // l: this thread's part
  const float scale = sm_scale * 1.4426950408889634f;
  const int last_row = min(row0 + BQ, q_len) - 1;
  const int shift = kv_len - q_len;  // causal: row r sees keys < shift + r + 1
  const int k_end = causal ? min(kv_len, shift + last_row + 1) : kv_len;
  // ASYNC: queue the copy of rows k0 .. k0 + BK of K (values false) or V into `tile` (rows past the
  // sequence's keys: zeros, stored directly) as one group
  auto stage = [&](half* tile, int k0, bool values) {
    for (int i = tid; i < BK * VEC; i += 128) {
      const int r = i / VEC, c = (i % VEC) * 8, kr = k0 + r;
      half* dst = tile + r * LD + c;
      if (kr < kv_len) {
        cp_async16(dst, (values ? keys.value(kr, kvh) : keys.key(kr, kvh)) + c);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    cp_async_commit();
  };
  if constexpr (ASYNC) {
    if (k_end > 0) stage(&ks[0][0], 0, false);  // groups in flight: K(0)
  }
  for (int k0 = 0; k0 < k_end; k0 += BK) {
    const bool more = k0 + BK < k_end;
    if constexpr (ASYNC) {
      stage(&vs[0][0], k0, true);  // the previous tile's P.V is done (barrier at the loop's end)
      cp_async_wait<1>();          // in flight: K(t), V(t) -> K(t) has arrived
    } else {
      for (int i = tid; i < BK * VEC; i += 128) {
        const int r = i / VEC, c = (i % VEC) * 8, kr = k0 + r;
        uint4 kv4 = make_uint4(0u, 0u, 0u, 0u), vv4 = kv4;
        if (kr < kv_len) {
          kv4 = *reinterpret_cast<const uint4*>(keys.key(kr, kvh) + c);
          vv4 = *reinterpret_cast<const uint4*>(keys.value(kr, kvh) + c);
        }
        *reinterpret_cast<uint4*>(&ks[r][c]) = kv4;
        *reinterpret_cast<uint4*>(&vs[r][c]) = vv4;
      }
    }
    __syncthreads();
    float s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const half* kp = &ks[n * 8 + g][kk * 16 + 2 * tq];
        mma_16816(s[n], qa[kk], *reinterpret_cast<const uint32_t*>(kp),
                  *reinterpret_cast<const uint32_t*>(kp + 8));
      }
    }
    if constexpr (ASYNC) {
      __syncthreads();                              // every warp's scores are read out of ks
      if (more) stage(&ks[0][0], k0 + BK, false);  // in flight: V(t), K(t + 1)
    }
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = k0 + n * 8 + 2 * tq + (e & 1), row = e < 2 ? r_lo : r_hi;
        const bool visible = col < kv_len && (!causal || col < shift + row + 1);
        s[n][e] = visible ? s[n][e] * scale : -INFINITY;
      }
      mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
    }
    const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
    const float base_lo = new_lo == -INFINITY ? 0.f : new_lo;  // a row with nothing visible yet
    const float base_hi = new_hi == -INFINITY ? 0.f : new_hi;
    const float a_lo = exp2f(m_lo - base_lo), a_hi = exp2f(m_hi - base_hi);
    m_lo = new_lo;
    m_hi = new_hi;
    l_lo *= a_lo;
    l_hi *= a_hi;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= a_lo; o[n][1] *= a_lo;
      o[n][2] *= a_hi; o[n][3] *= a_hi;
    }
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
      s[n][0] = exp2f(s[n][0] - base_lo); s[n][1] = exp2f(s[n][1] - base_lo);
      s[n][2] = exp2f(s[n][2] - base_hi); s[n][3] = exp2f(s[n][3] - base_hi);
      l_lo += s[n][0] + s[n][1];
      l_hi += s[n][2] + s[n][3];
    }
    if constexpr (ASYNC) {
      if (more) {
        cp_async_wait<1>();  // V(t) has arrived, K(t + 1) may still be in flight
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
    }
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint32_t pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                              pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const int kr = kk * 16 + 2 * tq;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + g;
        mma_16816(o[n], pa, pack_halves(vs[kr][c], vs[kr + 1][c]), pack_halves(vs[kr + 8][c], vs[kr + 9][c]));
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
  }
  const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
#pragma unroll
  for (int half_ = 0; half_ < 2; ++half_) {
    const int row = half_ ? r_hi : r_lo;
    if (row >= q_len) continue;
    const float inv = half_ ? inv_hi : inv_lo;
    half* op = out + ((size_t)(q_start + row) * H_QO + h) * D + 2 * tq;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<half2*>(op + n * 8) = __floats2half2_rn(o[n][2 * half_] * inv, o[n][2 * half_ + 1] * inv);
    if (tq == 0) {
      const float l = half_ ? l_hi : l_lo, m = half_ ? m_hi : m_lo;
      lse[(size_t)(q_start + row) * H_QO + h] = l > 0.f ? m + log2f(l) : -5e4f;
    }
  }
}


template <int H_QO, int H_KV, int D>
__device__ __forceinline__ void prefill_attention(const half* __restrict__ q, const int* __restrict__ q_indptr,
                                                  const half* __restrict__ k, const half* __restrict__ v,
                                                  const int* __restrict__ kv_indptr, half* __restrict__ out,
                                                  float* __restrict__ lse, int batch, int causal,
                                                  int rotary_mode, float sm_scale) {
  prefill_attention_tiles<H_QO, H_KV, D, false>(q, q_indptr, RaggedKeys<H_KV, D>{k, v, kv_indptr}, out, lse, batch,
                                                causal, rotary_mode, sm_scale);
}

template <int H_QO, int H_KV, int D, int PAGE, bool ASYNC = false>
__device__ __forceinline__ void prefill_paged_attention(const half* __restrict__ q, const int* __restrict__ q_indptr,
                                                        const half* __restrict__ pages,
                                                        const int* __restrict__ page_indptr,
                                                        const int* __restrict__ page_values,
                                                        const int* __restrict__ last_len, half* __restrict__ out,
                                                        float* __restrict__ lse, int batch, int causal,
                                                        int rotary_mode, float sm_scale) {
  prefill_attention_tiles<H_QO, H_KV, D, ASYNC>(q, q_indptr,
                                                PagedKeys<H_KV, D, PAGE>{pages, page_indptr, page_values, last_len},
                                                out, lse, batch, causal, rotary_mode, sm_scale);
}

}  // namespace llmchat

// ------------------------------------------------------------------------------------------------
// 5b. Decode attention on tensor cores for grouped-query heads (issue #18: decode at depth of GQA
//     models): GROUP = H_QO / H_KV <= 8 query heads share a kv head, head_dim 128. Grid (NC chunks,
//     H_KV, batch), WARPS warps. A block takes the GROUP query heads of one kv head over one chunk of
//     a sequence's keys, in steps of 16 keys (one page's slots) dealt round-robin to its warps; each
//     warp keeps its own online-softmax state (log2 domain, as TVM's kernels), then the warps' states
//     meet in shared memory and the chunks' in the scratch area (merge_chunks), as decode_attention's.
//     Per step, with mma.sync m16n8k16 (fp16 in, fp32 accumulators):
//     - S = Q K^T: rows the query heads (padded to 16 with zero queries), columns 8 keys per n-tile,
//       k the head dimension, permuted so that each lane loads 16 contiguous bytes of a key (and of
//       the query): k-steps 2p and 2p + 1 take dims 32p + 8tq .. + 8 of lane tq's word;
//     - O^T += V^T P^T: rows 16 dims per m-tile (lane row g: dims 8g + mt and 64 + 8g + mt), columns
//       the 8 heads, k the step's 16 keys. P^T's fragment is S's accumulator layout (no shuffles);
//       V^T's is packed by byte permutes from 16-byte loads of 8 dims of each of the lane's 4 keys.
//     Every key is read once per kv head (the cluster kernel reads it once per query head), and the
//     dot products are 3 MMAs per 16 keys and head instead of FMAs and shuffles.
// FUSED as decode_attention's: q and the new k, v come from the fused projection (RoPE here); the
// block whose chunk holds the new position writes k and v to their page slot and uses them from
// shared memory (the cache is read through the read-only path, which need not see that write).
// ------------------------------------------------------------------------------------------------
namespace llmchat {

template <int H_QO, int H_KV, int D, int PAGE, int NC, int WARPS, bool FUSED = false, int AHEAD = 2>
__device__ __forceinline__ void decode_attention_mma(const half* __restrict__ q, const half* __restrict__ pages,
                                                     const int* __restrict__ indptr,
                                                     const int* __restrict__ values,
                                                     const int* __restrict__ last_len, half* __restrict__ out,
                                                     float* __restrict__ lse, float sm_scale, int batch,
                                                     int rotary_mode, const int* __restrict__ q_pos = nullptr,
                                                     float rope_scale = 1.f, float rope_theta = 1e4f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int GROUP = H_QO / H_KV;
  static_assert(H_QO % H_KV == 0 && GROUP <= 8, "at most 8 query heads per kv head (the MMA's 8 columns)");
  static_assert(D == 128, "head_dim 128: 8 lane rows x 2 halves of 8 dims per m-tile");
  static_assert(PAGE % 16 == 0, "steps of 16 keys inside one page");
  static_assert(NC >= 1 && NC <= 32, "the merge gives each chunk one lane of a warp");
  const float scale = sm_scale * 1.4426950408889634f;  // log2(e)
  const int c = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int head0 = kvh * GROUP;
  const int lane = threadIdx.x, warp = threadIdx.y, tid = warp * 32 + lane;
  const int g = lane >> 2, tq = lane & 3;
  if (rotary_mode != 0) __trap();  // RoPE is applied before the cache (RopeMode.NORMAL) only
  const bool split = NC > 1 && batch * H_QO * NC <= ATTN_SCRATCH_ROWS &&
                     (size_t)batch * H_QO * NC * D <= (size_t)ATTN_SCRATCH_FLOATS && batch * H_KV <= ATTN_SCRATCH_ROWS;
  if (!split && c > 0) return;
  const int pb = indptr[b], pe = indptr[b + 1];
  const int len = (pe != pb) ? (pe - pb - 1) * PAGE + last_len[b] : 0;
  const int steps = (len + 15) / 16;
  const int per_chunk = split ? (steps + NC - 1) / NC : steps;
  const int s_begin = c * per_chunk, s_end = min(steps, s_begin + per_chunk);

  const bool fused = FUSED && batch == 1;
  __shared__ __align__(16) half rope_qk[FUSED ? GROUP + 1 : 1][FUSED ? D : 8];  // rotated q heads, then k
  const half* v_new = nullptr;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // one step: the 16 keys from st * 16 loaded from the cache (load_step), the new token's key and value
  // put in from shared memory (FUSED: new_token), then multiplied (math_step)
  auto load_step = [&](int st, uint4(&kf)[2][D / 32], uint4(&vf)[4][2]) {
    const int k0 = st * 16;
    const half* base = pages + (((size_t)values[pb + k0 / PAGE] * 2 * H_KV + kvh) * PAGE + k0 % PAGE) * D;
    const half* vbase = base + (size_t)H_KV * PAGE * D;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int key = n * 8 + g;  // this lane's key of n-tile n
      const bool ok = k0 + key < len;
#pragma unroll
      for (int p = 0; p < D / 32; ++p)
        kf[n][p] = ok ? *reinterpret_cast<const uint4*>(base + key * D + 32 * p + 8 * tq) : zero;
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int key = (kk >> 1) * 8 + 2 * tq + (kk & 1);  // keys 2tq, 2tq + 1, 8 + 2tq, 9 + 2tq
      const bool ok = k0 + key < len;
#pragma unroll
      for (int piece = 0; piece < 2; ++piece)
        vf[kk][piece] = ok ? *reinterpret_cast<const uint4*>(vbase + key * D + piece * 64 + 8 * g) : zero;
    }
  };
  // the first AHEAD steps' loads go out before the fused RoPE, whose latency they overlap
  uint4 kf[AHEAD][2][D / 32], vf[AHEAD][4][2];
  int st = s_begin + warp;
#pragma unroll
  for (int a = 0; a < AHEAD; ++a)
    if (st + a * WARPS < s_end) load_step(st + a * WARPS, kf[a], vf[a]);
  if constexpr (FUSED) {
    if (fused) {
      const half* qkv = fused_qkv_src;
      rope_rows<H_QO, D, GROUP>(rope_qk, qkv, head0, kvh, (float)q_pos[0] * rope_scale, rope_theta, WARPS * 32);
      v_new = qkv + (size_t)(H_QO + H_KV + kvh) * D;
      __syncthreads();
      const int p = len - 1;
      if (len > 0 && s_begin * 16 <= p && p < s_end * 16 && tid < D / 8) {
        half* kp = const_cast<half*>(pages) + (((size_t)values[pb + p / PAGE] * 2 * H_KV + kvh) * PAGE + p % PAGE) * D;
        *reinterpret_cast<uint4*>(kp + tid * 8) = *reinterpret_cast<const uint4*>(&rope_qk[GROUP][tid * 8]);
        *reinterpret_cast<uint4*>(kp + (size_t)H_KV * PAGE * D + tid * 8) =
            *reinterpret_cast<const uint4*>(v_new + tid * 8);
      }
    }
  }
  // the queries as A fragments (rows g + 8 are zero: a1 = a3 = 0)
  uint32_t qa[D / 16][2];
#pragma unroll
  for (int p = 0; p < D / 32; ++p) {
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (g < GROUP) {
      w = FUSED && fused ? *reinterpret_cast<const uint4*>(&rope_qk[FUSED ? g : 0][32 * p + 8 * tq])
                         : *reinterpret_cast<const uint4*>(q + ((size_t)b * H_QO + head0 + g) * D + 32 * p + 8 * tq);
    }
    qa[2 * p][0] = w.x;
    qa[2 * p][1] = w.y;
    qa[2 * p + 1][0] = w.z;
    qa[2 * p + 1][1] = w.w;
  }
  float o[D / 16][4];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;  // head g's (l: this lane's part)
  auto new_token = [&](int st, uint4(&kf)[2][D / 32], uint4(&vf)[4][2]) {
    const int k0 = st * 16;
    if constexpr (FUSED) {
      if (fused && k0 <= len - 1 && len - 1 < k0 + 16) {  // the new token: k and v from shared memory
        const int key = len - 1 - k0;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int p = 0; p < D / 32; ++p)
            if (n * 8 + g == key) kf[n][p] = *reinterpret_cast<const uint4*>(&rope_qk[GROUP][32 * p + 8 * tq]);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int piece = 0; piece < 2; ++piece)
            if ((kk >> 1) * 8 + 2 * tq + (kk & 1) == key)
              vf[kk][piece] = *reinterpret_cast<const uint4*>(v_new + piece * 64 + 8 * g);
      }
    }
  };
  auto math_step = [&](int st, const uint4(&kf)[2][D / 32], const uint4(&vf)[4][2]) {
    const int k0 = st * 16;
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const uint4& w = kf[n][j / 2];
        const uint32_t a[4] = {qa[j][0], 0u, qa[j][1], 0u};
        mma_16816(s[n], a, (j & 1) ? w.z : w.x, (j & 1) ? w.w : w.y);
      }
    }
    // s[n][e] (e < 2): head g, key k0 + 8n + 2tq + e
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[n][e] = k0 + n * 8 + 2 * tq + e < len ? s[n][e] * scale : -INFINITY;
        mx = fmaxf(mx, s[n][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float base_m = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m_run - base_m);
    m_run = m_new;
    float psum = 0.f;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[n][e] = exp2f(s[n][e] - base_m);
        psum += s[n][e];
      }
    l_run = l_run * alpha + psum;
    // O^T's columns are heads 2tq and 2tq + 1: their rescale factors from lanes 4 * head
    const float a_even = __shfl_sync(0xffffffffu, alpha, 8 * tq);
    const float a_odd = __shfl_sync(0xffffffffu, alpha, 8 * tq + 4);
    const uint32_t pb0 = pack_half2(s[0][0], s[0][1]), pb1 = pack_half2(s[1][0], s[1][1]);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      o[mt][0] *= a_even;
      o[mt][1] *= a_odd;
      o[mt][2] *= a_even;
      o[mt][3] *= a_odd;
      const int word = mt >> 1;
      const unsigned sel = (mt & 1) ? 0x7632u : 0x5410u;  // high or low halves of two words
      auto at = [&](int kk, int piece) { return reinterpret_cast<const uint32_t*>(&vf[kk][piece])[word]; };
      const uint32_t a[4] = {__byte_perm(at(0, 0), at(1, 0), sel), __byte_perm(at(0, 1), at(1, 1), sel),
                             __byte_perm(at(2, 0), at(3, 0), sel), __byte_perm(at(2, 1), at(3, 1), sel)};
      mma_16816(o[mt], a, pb0, pb1);
    }
  };
  // AHEAD steps' loads are in flight before the first one's math, so that their latencies overlap
  while (st < s_end) {
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      if (st + a * WARPS >= s_end) continue;
      if constexpr (FUSED) new_token(st + a * WARPS, kf[a], vf[a]);
      math_step(st + a * WARPS, kf[a], vf[a]);
    }
    st += AHEAD * WARPS;
#pragma unroll
    for (int a = 0; a < AHEAD; ++a)
      if (st + a * WARPS < s_end) load_step(st + a * WARPS, kf[a], vf[a]);
  }
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  // the warps' states -> shared memory: o[mt][e] is head 2tq + (e & 1), dim (e < 2 ? 0 : 64) + 8g + mt
  __shared__ float sm_o[WARPS][GROUP][D];
  __shared__ float sm_md[WARPS][GROUP][2];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * tq + (e & 1);
      if (head < GROUP) sm_o[warp][head][(e < 2 ? 0 : 64) + 8 * g + mt] = o[mt][e];
    }
  if (tq == 0 && g < GROUP) {
    sm_md[warp][g][0] = m_run == -INFINITY ? -5e4f : m_run;
    sm_md[warp][g][1] = l_run;
  }
  __syncthreads();
  for (int idx = tid; idx < GROUP * D; idx += WARPS * 32) {
    const int hg = idx / D, dim = idx % D;
    float mm, dd, oo;
    warps_state<GROUP, D, WARPS>(sm_o, sm_md, hg, dim, mm, dd, oo);
    const int head = head0 + hg;
    if (!split) {
      out[((size_t)b * H_QO + head) * D + dim] = __float2half_rn(dd > 0.f ? oo / dd : 0.f);
      if (dim == 0) lse[(size_t)b * H_QO + head] = dd > 0.f ? mm + log2f(dd) : -5e4f;
    } else {
      const size_t row = ((size_t)b * H_QO + head) * NC + c;
      attn_partial_o[row * D + dim] = oo;
      if (dim == 0) attn_partial_md[row] = make_float2(mm, dd);
    }
  }
  if (split) merge_chunks<H_QO, D, NC, GROUP, WARPS>(b, head0, b * H_KV + kvh, out, lse);
#else
  __trap();  // mma.sync m16n8k16 needs sm_80; cuda_attention.py uses this kernel on sm_90 only
#endif
}

}  // namespace llmchat

// ------------------------------------------------------------------------------------------------
// 6. Decode RMSNorm of one row of K float16 values (cuda_rms_norm.py), as TVM's rms_norm kernel
//    computes it: out = half(rsqrt(sum(x^2) / K + eps) * x * w) in float32. One block, a 16-byte
//    load of x and of w per thread, one barrier (TVM's kernel: 1,024 threads, 2-byte loads, three).
// ------------------------------------------------------------------------------------------------
namespace llmchat {

template <int K>
__device__ __forceinline__ void rms_norm_row(const half* __restrict__ x, const half* __restrict__ w,
                                             half* __restrict__ out, float eps) {
  static_assert(K % 8 == 0 && K / 8 <= 1024, "8 values per thread, one block");
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  uint4 xv = make_uint4(0u, 0u, 0u, 0u), wv = xv;
  if (t < K / 8) {
    xv = *reinterpret_cast<const uint4*>(x + t * 8);
    wv = *reinterpret_cast<const uint4*>(w + t * 8);
  }
  const half* xh = reinterpret_cast<const half*>(&xv);
  float xf[8], ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xf[j] = __half2float(xh[j]);
    ss = fmaf(xf[j], xf[j], ss);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  __shared__ float part[32];
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < (int)(blockDim.x / 32); ++i) total += part[i];
  if (t >= K / 8) return;
  const float rs = rsqrtf(total / (float)K + eps);
  const half* wh = reinterpret_cast<const half*>(&wv);
  uint4 res;
  half* r = reinterpret_cast<half*>(&res);
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = __float2half_rn((rs * xf[j]) * __half2float(wh[j]));
  *reinterpret_cast<uint4*>(out + t * 8) = res;
}

}  // namespace llmchat

// ------------------------------------------------------------------------------------------------
// 7. Prefill: q4f16_1 dequantizing GEMM, second form (issue #18: prompts at depth), for layers of
//    at least 128 outputs by multiples of 128 and K by multiples of 128. Block tile 128 tokens x
//    128 outputs, 4 warps of 64 x 64, steps of BK = 32 values of k (one q4 group) in a STAGES-deep
//    cp.async ring: activations (16-byte chunks, XOR-swizzled so that ldmatrix reads are free of
//    bank conflicts), each output row's 4 weight words and 4 group scales (those of the step's
//    group and the next three: one 8-byte copy). A warp decodes its own B fragments from the words
//    in registers (nibbles 2tq, 2tq + 1 of a word: values k and k + 1), so weights take no shared
//    memory tile and no barrier of their own; mma.sync m16n8k16 (fp16 in, fp32 accumulators) in
//    the same k order as section 4's WMMA kernel: the outputs are the same bits.
// ------------------------------------------------------------------------------------------------
namespace llmchat {

// 16 bytes global -> shared, zero-filled past src_bytes (0 or 16)
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem), "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))));
#endif
}

// values k, k + 1 of a word (nibbles at bits 4k, 4k + 4; `t` the word shifted right by 4k) as the
// half2 ((n - 7) * s) of each, rounded as section 4's decode rounds them
__device__ __forceinline__ uint32_t decode_pair(uint32_t t, half2 s2) {
  const uint32_t v = (t & 0xFu) | ((t << 12) & 0xF0000u) | 0x64006400u;
  const half2 h = __hmul2(__hsub2(as_half2(v), as_half2(0x64076407u)), s2);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <int K, int N, int MODE, bool BIAS, typename OutT, bool RECORD = false, int STAGES = 4>
__device__ __forceinline__ void q4f16_gemm_mma(const half* __restrict__ x, const uint32_t* __restrict__ w,
                                               const half* __restrict__ scale, const half* __restrict__ bias,
                                               const half* __restrict__ residual, OutT* __restrict__ out,
                                               int M) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (RECORD) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) fused_qkv_src = out;
  }
  constexpr int BM = 128, BN = 128, BK = 32, THREADS = 128;
  static_assert(K % 128 == 0 && N % BN == 0, "K by 128 (groups by 4), N by 128");
  constexpr int WORDS = K / 8, GROUPS = K / 32, STEPS = K / BK;
  __shared__ __align__(128) uint4 xs[STAGES][BM * BK / 8];  // [row][chunk ^ ((row >> 1) & 3)]
  __shared__ __align__(16) uint4 wsm[STAGES][BN];           // row n's 4 words of the step
  __shared__ __align__(16) uint2 ssm[STAGES][BN];           // row n's scales of groups step & ~3 .. + 3
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int g = lane >> 2, tq = lane & 3;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;

  auto issue = [&](int step, int slot) {
#pragma unroll
    for (int c = 0; c < BM * BK / 8 / THREADS; ++c) {
      const int f = tid + c * THREADS, r = f >> 2, ch = f & 3;
      const int row = m0 + r;
      const half* src = x + (size_t)(row < M ? row : 0) * K + step * BK + ch * 8;
      cp_async16_zfill(&xs[slot][r * 4 + (ch ^ ((r >> 1) & 3))], src, row < M ? 16 : 0);
    }
    cp_async16(&wsm[slot][tid], w + (size_t)(n0 + tid) * WORDS + step * (BK / 8));
    cp_async8(&ssm[slot][tid], scale + (size_t)(n0 + tid) * GROUPS + (step & ~3));
  };

  float acc[4][8][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < STEPS) issue(s, s);
    cp_async_commit();
  }
  for (int step = 0; step < STEPS; ++step) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // the step's tiles are in; every warp is done with the slot refilled below
    {
      const int next = step + STAGES - 1;
      if (next < STEPS) issue(next, next % STAGES);
      cp_async_commit();
    }
    const int slot = step % STAGES;
    const uint4* xt = xs[slot];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t a[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int r = wm * 64 + mt * 16 + (lane & 15), ch = kk * 2 + (lane >> 4);
        ldmatrix_x4(a[mt], &xt[r * 4 + (ch ^ ((r >> 1) & 3))]);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int n = wn * 64 + nt * 8 + g;
        const uint2 wd = reinterpret_cast<const uint2*>(&wsm[slot][n])[kk];
        const uint2 sc = ssm[slot][n];
        const uint32_t sw = (step & 2) ? sc.y : sc.x;
        const half sh = as_half2(sw).x;
        const half s = (step & 1) ? __high2half(as_half2(sw)) : sh;
        const half2 s2 = __half2half2(s);
        const uint32_t b0 = decode_pair(wd.x >> (8 * tq), s2), b1 = decode_pair(wd.y >> (8 * tq), s2);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) mma_16816(acc[mt][nt], a[mt], b0, b1);
      }
    }
  }
  cp_async_wait<0>();
  // acc[mt][nt]: rows wm * 64 + mt * 16 + g (+ 8 for e >= 2), columns wn * 64 + nt * 8 + 2tq (+ 1 for odd e)
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int half_rows = 0; half_rows < 2; ++half_rows) {
      const int row = m0 + wm * 64 + mt * 16 + g + half_rows * 8;
      if (row >= M) continue;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = n0 + wn * 64 + nt * 8 + 2 * tq;
        const size_t o = (size_t)row * N + col;
        float v0 = acc[mt][nt][2 * half_rows], v1 = acc[mt][nt][2 * half_rows + 1];
        if constexpr (MODE == 0) {
          *reinterpret_cast<float2*>(out + o) = make_float2(v0, v1);
        } else {
          if constexpr (BIAS) {
            v0 += __half2float(bias[col]);
            v1 += __half2float(bias[col + 1]);
          }
          half h0 = __float2half_rn(v0), h1 = __float2half_rn(v1);
          if constexpr (MODE == 2) {
            h0 = __hadd(residual[o], h0);
            h1 = __hadd(residual[o + 1], h1);
          }
          *reinterpret_cast<half2*>(out + o) = __halves2half2(h0, h1);
        }
      }
    }
#else
  __trap();  // cp.async, ldmatrix and mma.sync m16n8k16 need sm_80
#endif
}

}  // namespace llmchat
