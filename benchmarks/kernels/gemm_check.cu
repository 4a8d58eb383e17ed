// llmchat::q4f16_gemm (prompt matmuls) with 2 and 4 warps along the outputs (WN) against the kernel
// before session 17 (before_kernels.cu: see README.md) and a
// double-precision host reference on sampled outputs, with every kernel's time. The accumulation
// order is the same in every shape, so the outputs must be bit-identical to the kernel before.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o gemm_check gemm_check.cu
// Run on the GPU machine: ./gemm_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include "before_kernels.cu"
#include <cstdio>
#include <vector>
#include <random>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
template<int K,int N,int ST> __global__ void __launch_bounds__(128) kmma(const half* x,const uint32_t* w,const half* s,const half* r,half* o,int M){ llmchat::q4f16_gemm_mma<K,N,2,false,half,false,ST>(x,w,s,nullptr,r,o,M); }
template<int K,int N,int BM,int WN> __global__ void __launch_bounds__(64*WN) knew(const half* x,const uint32_t* w,const half* s,const half* r,half* o,int M){ llmchat::q4f16_gemm<K,N,BM,2,false,half,false,WN>(x,w,s,nullptr,r,o,M); }
template<int K,int N,int BM> __global__ void __launch_bounds__(128) kbefore(const half* x,const uint32_t* w,const half* s,const half* r,half* o,int M){ llmchat_before::q4f16_gemm<K,N,BM,2,false,half>(x,w,s,nullptr,r,o,M); }
struct Data { uint32_t* dw; half *ds,*dx,*dr; std::vector<uint32_t> hw; std::vector<half> hs,hx,hr; };
template<int K,int N> Data make(int M){ Data d; std::mt19937 rng(3); std::uniform_int_distribution<uint32_t> ui; std::normal_distribution<float> nd(0.f,1.f);
  d.hw.resize((size_t)N*K/8); for(auto& v:d.hw) v=ui(rng);
  d.hs.resize((size_t)N*K/32); d.hx.resize((size_t)M*K); d.hr.resize((size_t)M*N);
  for(auto& v:d.hs) v=__float2half(0.02f*(0.5f+std::fabs(nd(rng)))); for(auto& v:d.hx) v=__float2half(nd(rng)); for(auto& v:d.hr) v=__float2half(nd(rng));
  CK(cudaMalloc(&d.dw,d.hw.size()*4)); CK(cudaMalloc(&d.ds,d.hs.size()*2)); CK(cudaMalloc(&d.dx,d.hx.size()*2)); CK(cudaMalloc(&d.dr,d.hr.size()*2));
  cudaMemcpy(d.dw,d.hw.data(),d.hw.size()*4,cudaMemcpyHostToDevice); cudaMemcpy(d.ds,d.hs.data(),d.hs.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(d.dx,d.hx.data(),d.hx.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(d.dr,d.hr.data(),d.hr.size()*2,cudaMemcpyHostToDevice);
  return d; }
template<typename F> float timeit(F f){ cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); f(); cudaDeviceSynchronize(); float best=1e9;
  for(int r=0;r<5;r++){ cudaEventRecord(a); for(int i=0;i<20;i++) f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms,a,b); best=fminf(best,ms/20);} return best*1e3f; }
template<int K,int N,int BM> void run(int M, const char* name){
  Data d=make<K,N>(M); half *ref,*o; CK(cudaMalloc(&ref,d.hr.size()*2)); CK(cudaMalloc(&o,d.hr.size()*2));
  const double fl=2.0*M*N*K;
  dim3 g0(N/64,(M+BM-1)/BM);
  auto before=[&]{ kbefore<K,N,BM><<<g0,128>>>(d.dx,d.dw,d.ds,d.dr,ref,M); };
  before(); CK(cudaDeviceSynchronize());
  std::vector<half> hb(d.hr.size()); cudaMemcpy(hb.data(),ref,hb.size()*2,cudaMemcpyDeviceToHost);
  std::mt19937 rng(7); std::uniform_int_distribution<uint32_t> ui; double maxe=0, maxref=0;
  for(int t=0;t<200;t++){ int m=ui(rng)%M, n=ui(rng)%N; double acc=0;
    for(int k=0;k<K;k++){ uint32_t word=d.hw[(size_t)n*(K/8)+k/8]; int nib=(word>>(4*(k%8)))&15; double wv=(double)__half2float(__float2half((nib-7)*__half2float(d.hs[(size_t)n*(K/32)+k/32]))); acc+=wv*__half2float(d.hx[(size_t)m*K+k]); }
    double r=__half2float(d.hr[(size_t)m*N+n])+acc; maxe=fmax(maxe,fabs(r-__half2float(hb[(size_t)m*N+n]))); maxref=fmax(maxref,fabs(r)); }
  const float tb=timeit(before);
  printf("%-10s M=%-5d K=%-5d N=%-5d before  %8.1f us %4.0f TF  vs host max err %.3g (|ref| %.3g)\n",name,M,K,N,tb,fl/(tb*1e-6)/1e12,maxe,maxref);
  auto variant=[&](auto kern, int wn){
    if(N%(32*wn)) return;
    dim3 g(N/(32*wn),(M+BM-1)/BM);
    auto f=[&]{ kern<<<g,64*wn>>>(d.dx,d.dw,d.ds,d.dr,o,M); };
    CK(cudaMemset(o,0,d.hr.size()*2)); f(); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    std::vector<half> ho(d.hr.size()); cudaMemcpy(ho.data(),o,ho.size()*2,cudaMemcpyDeviceToHost);
    size_t diff=0; for(size_t i=0;i<ho.size();i++) diff+= (*(uint16_t*)&ho[i]!=*(uint16_t*)&hb[i]);
    const float t=timeit(f);
    printf("%-10s %38s WN=%d %8.1f us %4.0f TF  %5.2fx  %s\n",name,"",wn,t,fl/(t*1e-6)/1e12,tb/t,diff?"DIFFERENT":"bit-identical");
  };
  variant(knew<K,N,BM,2>,2); variant(knew<K,N,BM,4>,4);
  auto mma=[&](auto kern, const char* what){
    if(N%128 || K%128) return;
    dim3 g(N/128,(M+127)/128);
    auto f=[&]{ kern<<<g,128>>>(d.dx,d.dw,d.ds,d.dr,o,M); };
    CK(cudaMemset(o,0,d.hr.size()*2)); f(); CK(cudaDeviceSynchronize()); CK(cudaGetLastError());
    std::vector<half> ho(d.hr.size()); cudaMemcpy(ho.data(),o,ho.size()*2,cudaMemcpyDeviceToHost);
    size_t diff=0; double md=0; for(size_t i=0;i<ho.size();i++){ if(*(uint16_t*)&ho[i]!=*(uint16_t*)&hb[i]){ diff++; md=fmax(md,fabs(__half2float(ho[i])-__half2float(hb[i]))); } }
    const float t=timeit(f);
    printf("%-10s %38s %-4s %8.1f us %4.0f TF  %5.2fx  %s", name, "", what, t, fl/(t*1e-6)/1e12, tb/t, diff?"DIFFERENT":"bit-identical");
    if(diff) printf(" (%zu of %zu, max diff %.3g)", diff, ho.size(), md);
    printf("\n");
  };
  mma(kmma<K,N,4>,"mma4"); mma(kmma<K,N,3>,"mma3");
  cudaFree(d.dw);cudaFree(d.ds);cudaFree(d.dx);cudaFree(d.dr);cudaFree(ref);cudaFree(o);
}
int main(){
  // Llama-3-8B (4096 -> 6144 qkv, 4096 o, 28672 gate_up, 14336 -> 4096 down), Llama-2-7B, Qwen2.5-3B, 0.5B
  run<4096,6144,128>(2048,"8b qkv"); run<4096,4096,128>(2048,"8b o"); run<4096,28672,128>(2048,"8b gu"); run<14336,4096,128>(2048,"8b down");
  run<4096,12288,128>(512,"7b qkv"); run<4096,4096,128>(512,"7b o"); run<4096,22016,128>(512,"7b gu"); run<11008,4096,128>(512,"7b down");
  run<2048,2560,64>(512,"3b qkv"); run<2048,22016,128>(512,"3b gu"); run<896,1152,64>(77,"05 qkv"); run<4864,896,64>(512,"05 down"); run<896,9728,128>(512,"05 gu");
  run<4096,4096,128>(1,"o M=1"); run<4096,4096,64>(150,"o M=150");
  return 0;
}
