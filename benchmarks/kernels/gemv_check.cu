// llmchat::q4f16_gemv (decode) with the layouts cuda_gemv.choose_layout picks against the previous
// kernel with the layouts it had (prev_kernels.cu: see README.md), weights rotating through 32 layers
// in a CUDA graph (no L2 reuse), plus a double-precision host reference on sampled rows.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o gemv_check gemv_check.cu
// Run on the GPU machine: ./gemv_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include "prev_kernels.cu"
#include <cstdio>
#include <vector>
#include <random>
#include <cmath>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
constexpr int L = 32;
// TVM launches these with __launch_bounds__(threads per block): 128 for 4 warps, 256 for 8
template<int K,int N,int R,int S,int MODE,typename O> __global__ void __launch_bounds__(128) knew4(const half* x,const uint32_t* w,const half* s,const half* r,O* o){ llmchat::q4f16_gemv<K,N,R,S,MODE,false,O>(x,w,s,nullptr,r,o); }
template<int K,int N,int R,int S,int MODE,typename O> __global__ void __launch_bounds__(256) knew8(const half* x,const uint32_t* w,const half* s,const half* r,O* o){ llmchat::q4f16_gemv<K,N,R,S,MODE,false,O>(x,w,s,nullptr,r,o); }
template<int K,int N,int R,int S,int MODE,typename O> __global__ void __launch_bounds__(128) kold(const half* x,const uint32_t* w,const half* s,const half* r,O* o){ llmchat_prev::q4f16_gemv<K,N,R,S,MODE,false,O>(x,w,s,nullptr,r,o); }
cudaStream_t st;
template<typename F> float tgraph(F body){ cudaGraph_t g; cudaGraphExec_t ge; CK(cudaStreamBeginCapture(st,cudaStreamCaptureModeGlobal)); body(); CK(cudaStreamEndCapture(st,&g)); CK(cudaGraphInstantiate(&ge,g,0));
  for(int i=0;i<3;i++) cudaGraphLaunch(ge,st); cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); float best=1e9;
  for(int r=0;r<5;r++){ cudaEventRecord(a,st); for(int i=0;i<20;i++) cudaGraphLaunch(ge,st); cudaEventRecord(b,st); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms,a,b); best=fminf(best,ms/20);} CK(cudaGetLastError()); CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g)); return best*1000.f/L; }
// new layout: R rows per warp, W warps per block, S warps per set of rows; old: RO, 4 warps, SO
template<int K,int N,int MODE,int R,int W,int S,int RO,int SO,typename O> void run(const char* name){
  std::mt19937 rng(5); std::uniform_int_distribution<uint32_t> ui; std::normal_distribution<float> nd(0.f,1.f);
  size_t WN=(size_t)N*K/8, SN_=(size_t)N*K/32; uint32_t* w; half *s,*x,*res; O *o1,*o2;
  CK(cudaMalloc(&w,WN*4*L)); CK(cudaMalloc(&s,SN_*2*L)); CK(cudaMalloc(&x,K*2)); CK(cudaMalloc(&res,N*2)); CK(cudaMalloc(&o1,N*sizeof(O))); CK(cudaMalloc(&o2,N*sizeof(O)));
  std::vector<uint32_t> hw(WN); for(auto& v:hw) v=ui(rng); std::vector<half> hs(SN_), hx(K), hr(N);
  for(auto& v:hs) v=__float2half(0.02f*(0.5f+std::fabs(nd(rng)))); for(auto& v:hx) v=__float2half(nd(rng)); for(auto& v:hr) v=__float2half(nd(rng));
  for(int l=0;l<L;l++){ cudaMemcpy(w+WN*l,hw.data(),WN*4,cudaMemcpyHostToDevice); cudaMemcpy(s+SN_*l,hs.data(),SN_*2,cudaMemcpyHostToDevice);}
  cudaMemcpy(x,hx.data(),K*2,cudaMemcpyHostToDevice); cudaMemcpy(res,hr.data(),N*2,cudaMemcpyHostToDevice);
  auto knew = (W == 4) ? knew4<K,N,R,S,MODE,O> : knew8<K,N,R,S,MODE,O>;
  dim3 bn(32,W), bo(32,4); int gn=N/(R*W/S), go=N/(RO*4/SO);
  knew<<<gn,bn>>>(x,w,s,res,o1); kold<K,N,RO,SO,MODE,O><<<go,bo>>>(x,w,s,res,o2); CK(cudaDeviceSynchronize());
  std::vector<O> r1(N), r2(N); cudaMemcpy(r1.data(),o1,N*sizeof(O),cudaMemcpyDeviceToHost); cudaMemcpy(r2.data(),o2,N*sizeof(O),cudaMemcpyDeviceToHost);
  auto f=[](auto v){ return (double)(float)v; };
  double dmax=0, emax=0, ref_max=0;
  for(int i=0;i<N;i++) dmax=fmax(dmax,fabs(f(r1[i])-f(r2[i])));
  auto rowdot=[&](int n){ double a=0; for(int k=0;k<K;k++){ int nib=(hw[(size_t)n*(K/8)+k/8]>>(4*(k%8)))&15; a+=(nib-7)*(double)__half2float(hs[(size_t)n*(K/32)+k/32])*__half2float(hx[k]); } return a; };
  for(int t=0;t<64;t++){ int n=ui(rng)%N; double ref=rowdot(n); if(MODE==2) ref+=__half2float(hr[n]);
    emax=fmax(emax,fabs(ref-f(r1[n]))); ref_max=fmax(ref_max,fabs(ref)); }
  float tn=tgraph([&]{ for(int l=0;l<L;l++) knew<<<gn,bn,0,st>>>(x,w+WN*l,s+SN_*l,res,o1); });
  float to=tgraph([&]{ for(int l=0;l<L;l++) kold<K,N,RO,SO,MODE,O><<<go,bo,0,st>>>(x,w+WN*l,s+SN_*l,res,o2); });
  double bytes=WN*4+SN_*2;
  printf("%-8s K=%5d N=%6d new R%dW%dS%d %6.2f us (%.2f TB/s) | old R%dW4S%d %6.2f us | new-old max %.3g, new vs host max err %.3g (|ref| %.3g)\n",
         name,K,N,R,W,S,tn,bytes/tn/1e6,RO,SO,to,dmax,emax,ref_max);
  cudaFree(w);cudaFree(s);cudaFree(x);cudaFree(res);cudaFree(o1);cudaFree(o2);
}
int main(){ CK(cudaStreamCreate(&st));
  // Llama-2-7B
  run<4096,12288,1, 4,4,4, 4,1, half>("qkv");
  run<4096,4096,2,  4,4,4, 4,4, half>("o");
  run<4096,22016,1, 4,4,4, 4,4, half>("gate_up");
  run<11008,4096,2, 4,8,4, 4,4, half>("down");
  run<4096,32000,0, 4,4,4, 4,4, float>("lm_head");
  // Qwen2.5-3B shape
  run<2048,2560,1,  4,4,2, 4,2, half>("qkv3b");
  run<2048,22016,1, 4,4,2, 4,2, half>("gu3b");
  run<11008,2048,2, 4,8,4, 4,4, half>("down3b");
  // Qwen2.5-0.5B shape
  run<896,1152,1,   4,4,1, 4,1, half>("qkv05");
  run<896,9728,1,   4,4,1, 4,1, half>("gu05");
  run<4864,896,2,   4,8,4, 4,4, half>("down05");
  return 0; }
