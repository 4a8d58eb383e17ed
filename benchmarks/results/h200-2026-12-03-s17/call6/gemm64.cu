// throwaway (session 17): q4f16 GEMM with 64x64 warp tiles (4 warps, 128x128 block) against
// llmchat::q4f16_gemm WN=2 and WN=4; bit-identity and time
#include "../../../../app/inference/pipelines/cuda_kernels.cu"  // from benchmarks/results/h200-2026-12-03-s17/call6
#include <cstdio>
#include <vector>
#include <random>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
using namespace nvcuda;
template <int K, int N, int BM, int FN>
__global__ void __launch_bounds__(128) g64(const half* __restrict__ x, const uint32_t* __restrict__ w, const half* __restrict__ scale,
                                          const half* __restrict__ residual, half* __restrict__ out, int M) {
  constexpr int BN = 32 * FN, BK = 64, LD = BK + 8, WORDS = K / 8, GROUPS = K / 32, STEPS = K / BK;
  constexpr int FM = BM / 32, XC = BM * BK / 8 / 128, RPT = BN / 128 > 0 ? BN / 128 : 1;  // weight rows per thread
  static_assert(BN <= 128 || BN == 256, "");
  constexpr int TPR = 128 / BN;  // threads per weight row (1 when BN == 128, 2 when 64)
  constexpr int WW = 8 / TPR;    // words per thread per row
  constexpr int TILE = (BM + BN) * LD * 2, CB = BM / 2 * (BN + 4) * 4;
  __shared__ __align__(128) unsigned char smem[TILE > CB ? TILE : CB];
  half(*xs)[LD] = reinterpret_cast<half(*)[LD]>(smem);
  half(*ws)[LD] = reinterpret_cast<half(*)[LD]>(smem + BM * LD * 2);
  float(*cs)[BN + 4] = reinterpret_cast<float(*)[BN + 4]>(smem);
  const int tid = threadIdx.x, warp = tid / 32, wm = warp / 2, wn = warp % 2;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  const int wr = tid / TPR, wpart = tid % TPR;
  uint4 xr[XC]; uint32_t wq[WW]; half wsc[2];
  auto load = [&](int step) {
#pragma unroll
    for (int c = 0; c < XC; ++c) { const int chunk = tid + c * 128, r = chunk / 8, part = chunk % 8;
      xr[c] = make_uint4(0u,0u,0u,0u); if (m0 + r < M) xr[c] = *reinterpret_cast<const uint4*>(x + (size_t)(m0 + r) * K + step * BK + part * 8); }
    const uint32_t* row = w + (size_t)(n0 + wr) * WORDS + step * 8 + wpart * WW;
#pragma unroll
    for (int i = 0; i < WW; i += 4) { const uint4 q = *reinterpret_cast<const uint4*>(row + i); wq[i]=q.x; wq[i+1]=q.y; wq[i+2]=q.z; wq[i+3]=q.w; }
#pragma unroll
    for (int gi = 0; gi < WW / 4; ++gi) wsc[gi] = scale[(size_t)(n0 + wr) * GROUPS + step * 2 + wpart + gi];
  };
  auto stage = [&]() {
#pragma unroll
    for (int c = 0; c < XC; ++c) { const int chunk = tid + c * 128, r = chunk / 8, part = chunk % 8; *reinterpret_cast<uint4*>(&xs[r][part * 8]) = xr[c]; }
    const half2 offset = llmchat::as_half2(0x64076407u);
#pragma unroll
    for (int i = 0; i < WW; ++i) {
      const half2 s2 = __half2half2(wsc[i / 4]);
      uint32_t v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) { half2 h = __hmul2(__hsub2(llmchat::as_half2(llmchat::and_or(wq[i] >> (4 * j), 0x000F000Fu, 0x64006400u)), offset), s2); v[j] = *reinterpret_cast<uint32_t*>(&h); }
      *reinterpret_cast<uint4*>(&ws[wr][(wpart * WW + i) * 8]) = make_uint4(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410), __byte_perm(v[0], v[1], 0x7632), __byte_perm(v[2], v[3], 0x7632));
    }
  };
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FM][FN];
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  load(0);
  for (int step = 0; step < STEPS; ++step) {
    stage(); __syncthreads();
    if (step + 1 < STEPS) load(step + 1);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> bf[FN];
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::load_matrix_sync(bf[j], &ws[wn * (BN / 2) + j * 16][kk], LD);
#pragma unroll
      for (int i = 0; i < FM; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a;
        wmma::load_matrix_sync(a, &xs[wm * (BM / 2) + i * 16][kk], LD);
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], a, bf[j], acc[i][j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    if (pass) __syncthreads();
    if (wm == pass) {
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::store_matrix_sync(&cs[i * 16][wn * (BN / 2) + j * 16], acc[i][j], BN + 4, wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = tid; idx < BM / 2 * BN; idx += 128) {
      const int r = pass * (BM / 2) + idx / BN, c = idx % BN;
      if (m0 + r >= M) continue;
      const size_t o = (size_t)(m0 + r) * N + n0 + c;
      out[o] = __hadd(residual[o], __float2half_rn(cs[r - pass * (BM / 2)][c]));
    }
  }
}
template<int K,int N,int BM,int WN> __global__ void __launch_bounds__(64*WN) kcur(const half* x,const uint32_t* w,const half* s,const half* r,half* o,int M){ llmchat::q4f16_gemm<K,N,BM,2,false,half,false,WN>(x,w,s,nullptr,r,o,M); }
template<typename F> float timeit(F f){ cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); f(); cudaDeviceSynchronize(); float best=1e9;
  for(int r=0;r<5;r++){ cudaEventRecord(a); for(int i=0;i<20;i++) f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms,a,b); best=fminf(best,ms/20);} return best*1e3f; }
template<int K,int N,int BM> void run(int M,const char* name){
  std::mt19937 rng(3); std::uniform_int_distribution<uint32_t> ui; std::normal_distribution<float> nd(0.f,1.f);
  std::vector<uint32_t> hw((size_t)N*K/8); for(auto& v:hw) v=ui(rng);
  std::vector<half> hs((size_t)N*K/32), hx((size_t)M*K), hr((size_t)M*N);
  for(auto& v:hs) v=__float2half(0.02f*(0.5f+std::fabs(nd(rng)))); for(auto& v:hx) v=__float2half(nd(rng)); for(auto& v:hr) v=__float2half(nd(rng));
  uint32_t* dw; half *ds,*dx,*dr,*o1,*o2; CK(cudaMalloc(&dw,hw.size()*4)); CK(cudaMalloc(&ds,hs.size()*2)); CK(cudaMalloc(&dx,hx.size()*2)); CK(cudaMalloc(&dr,hr.size()*2)); CK(cudaMalloc(&o1,hr.size()*2)); CK(cudaMalloc(&o2,hr.size()*2));
  cudaMemcpy(dw,hw.data(),hw.size()*4,cudaMemcpyHostToDevice); cudaMemcpy(ds,hs.data(),hs.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(dx,hx.data(),hx.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(dr,hr.data(),hr.size()*2,cudaMemcpyHostToDevice);
  const double fl=2.0*M*N*K;
  auto c2=[&]{ kcur<K,N,BM,2><<<dim3(N/64,(M+BM-1)/BM),128>>>(dx,dw,ds,dr,o1,M); };
  auto c4=[&]{ kcur<K,N,BM,4><<<dim3(N/128,(M+BM-1)/BM),256>>>(dx,dw,ds,dr,o1,M); };
  auto e4=[&]{ g64<K,N,BM,4><<<dim3(N/128,(M+BM-1)/BM),128>>>(dx,dw,ds,dr,o2,M); };
  c4(); e4(); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
  std::vector<half> a(hr.size()), b(hr.size()); cudaMemcpy(a.data(),o1,a.size()*2,cudaMemcpyDeviceToHost); cudaMemcpy(b.data(),o2,b.size()*2,cudaMemcpyDeviceToHost);
  size_t diff=0; for(size_t i=0;i<a.size();i++) diff+=(*(uint16_t*)&a[i]!=*(uint16_t*)&b[i]);
  const float t2=timeit(c2), t4=timeit(c4), t64=timeit(e4);
  printf("%-9s M=%-5d K=%-5d N=%-5d WN2 %7.1f us %4.0f TF | WN4 %7.1f us %4.0f TF | 64x64 %7.1f us %4.0f TF (%.2fx WN4) %s\n",name,M,K,N,t2,fl/(t2*1e-6)/1e12,t4,fl/(t4*1e-6)/1e12,t64,fl/(t64*1e-6)/1e12,t4/t64,diff?"DIFFERENT":"bit-identical");
  cudaFree(dw);cudaFree(ds);cudaFree(dx);cudaFree(dr);cudaFree(o1);cudaFree(o2);
}
int main(){
  run<4096,6144,128>(2048,"8b qkv"); run<4096,4096,128>(2048,"8b o"); run<4096,28672,128>(2048,"8b gu"); run<14336,4096,128>(2048,"8b down");
  run<4096,12288,128>(512,"7b qkv"); run<4096,4096,128>(512,"7b o"); run<4096,22016,128>(512,"7b gu"); run<11008,4096,128>(512,"7b down");
  return 0;
}
