// Decode attention of grouped-query models (issue #18): llmchat::decode_attention_mma (tensor cores,
// the query heads of a kv head together) against the kernels cuda_attention.py launches today on
// sm_90 (one query head per block in clusters; blocks of 4 query heads for GQA-4 from 3,072 keys),
// each checked against a double-precision host reference (outputs and lse) and timed per layer,
// 32 layers in a CUDA graph, contexts of 1 to 8,192 keys.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o gqa_decode_check gqa_decode_check.cu
// Run on the GPU machine: ./gqa_decode_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include "before_kernels.cu"  // generated: see README.md (the kernels before session 17)
#include "decode_setup.cuh"

using Args = void (*)(const half*, const half*, const int*, const int*, const int*, half*, float*, float);
template <int HQ, int HK, int D, int NC, int W, int AHEAD = 2>
__global__ void __launch_bounds__(W * 32) kmma(const half* q, const half* pages, const int* ip, const int* vals,
                                               const int* ll, half* o, float* lse, float sm) {
  llmchat::decode_attention_mma<HQ, HK, D, PAGE, NC, W, false, AHEAD>(q, pages, ip, vals, ll, o, lse, sm, 1, 0);
}
template <int HQ, int HK, int D, int NC, int W>
__global__ void __launch_bounds__(W * 32) kprev(const half* q, const half* pages, const int* ip, const int* vals,
                                                const int* ll, half* o, float* lse, float sm) {
  llmchat_before::decode_attention_mma<HQ, HK, D, PAGE, NC, W>(q, pages, ip, vals, ll, o, lse, sm, 1, 0);
}
template <int HQ, int HK, int D, int NC, int GH, int W, bool CL>
__global__ void __launch_bounds__(W * 32) kold(const half* q, const half* pages, const int* ip, const int* vals,
                                               const int* ll, half* o, float* lse, float sm) {
  llmchat::decode_attention<HQ, HK, D, PAGE, NC, GH, W, CL>(q, pages, ip, vals, ll, o, lse, sm, 1, 0);
}
// launch `k` on a (x, y) grid of W-warp blocks for every layer (cluster: x blocks per cluster); check
// layer 0, time all
template <int HQ, int HK, int D>
void run(const char* what, Args k, Setup<HQ, HK, D>& s, float sm, int x, int y, int w, bool cluster) {
  if (cluster && x > 8) CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  auto go = [&](int l, cudaStream_t stream) {
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(x, y, 1);
    c.blockDim = dim3(32, w);
    c.stream = stream;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = x;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    c.attrs = at;
    c.numAttrs = cluster ? 1 : 0;
    CK(cudaLaunchKernelEx(&c, k, (const half*)(s.q + (size_t)HQ * D * l), (const half*)(s.p + s.per() * l),
                          (const int*)s.ip, (const int*)s.vl, (const int*)s.ll, s.o + (size_t)HQ * D * l,
                          s.lse + HQ * l, sm));
  };
  CK(cudaMemset(s.o, 0, (size_t)HQ * D * 2));
  go(0, 0);
  CK(cudaDeviceSynchronize());
  const double e = s.check(sm);
  const float t = tgraph([&] { for (int l = 0; l < L; l++) go(l, st); });
  printf("  %-34s %7.2f us  %6.1f GB/s  max err %.2g%s\n", what, t, 2.0 * s.len * HK * D * 2 / (t * 1e3), e,
         e > 2e-3 ? "  WRONG" : "");
}
template <int HQ, int HK, int D>
void shape(const char* name) {
  const float sm = 1.f / sqrtf((float)D);
  for (int len : {1, 17, 266, 1024, 2048, 3072, 4096, 8191, 8192}) {
    Setup<HQ, HK, D> s(len);
    printf("%s, %d keys\n", name, len);
    run<HQ, HK, D>("before: mma, 32 chunks, 8 warps", kprev<HQ, HK, D, 32, 8>, s, sm, 32, HK, 8, false);
    run<HQ, HK, D>("mma, 32 chunks, 8 warps, 1 ahead", kmma<HQ, HK, D, 32, 8, 1>, s, sm, 32, HK, 8, false);
    run<HQ, HK, D>("mma, 32 chunks, 8 warps, 2 ahead", kmma<HQ, HK, D, 32, 8, 2>, s, sm, 32, HK, 8, false);
    run<HQ, HK, D>("mma, 32 chunks, 4 warps, 2 ahead", kmma<HQ, HK, D, 32, 4, 2>, s, sm, 32, HK, 4, false);
    run<HQ, HK, D>("mma, 16 chunks, 8 warps, 2 ahead", kmma<HQ, HK, D, 16, 8, 2>, s, sm, 16, HK, 8, false);
    run<HQ, HK, D>("mma, 16 chunks, 4 warps, 2 ahead", kmma<HQ, HK, D, 16, 4, 2>, s, sm, 16, HK, 4, false);
    if constexpr (HQ / HK <= 4)  // shared memory: 16 warps' states of 4 heads
      run<HQ, HK, D>("mma, 32 chunks, 16 warps, 1 ahead", kmma<HQ, HK, D, 32, 16, 1>, s, sm, 32, HK, 16, false);
    run<HQ, HK, D>("cluster, 8 chunks, 1 head, 8 warps", kold<HQ, HK, D, 8, 1, 8, true>, s, sm, 8, HQ, 8, true);
    if constexpr (HQ / HK == 4)
      run<HQ, HK, D>("groups of 4 heads, 32 chunks, 8 w", kold<HQ, HK, D, 32, 4, 8, false>, s, sm, 32, HQ / 4, 8,
                     false);
  }
}
int main() {
  CK(cudaStreamCreate(&st));
  shape<32, 8, 128>("Llama-3-8B (32 heads, 8 kv heads, 128)");
  shape<28, 4, 128>("Qwen2.5-7B (28, 4, 128)");
  shape<16, 2, 128>("Qwen2.5-3B (16, 2, 128)");
  return 0;
}
