// llmchat::q4f16_gemv in its SiLU-pairs mode (MODE 3: the gate_up GEMV writes silu(gate) * up, see
// cuda_silu_gate.py) against the plain GEMV followed by TVM's split-silu-multiply kernel (its CUDA as
// TVM generates it for Llama-2-7B): outputs compared bit for bit, times with weights rotating through
// 32 layers in a CUDA graph, on the three benchmark shapes.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o silu_gate_check silu_gate_check.cu
// Run on the GPU machine: ./silu_gate_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include <cstdio>
#include <vector>
#include <random>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
constexpr int L = 32;
template<int K,int N,int R,int S,int MODE> __global__ void __launch_bounds__(128) g4(const half* x,const uint32_t* w,const half* s,half* o){ llmchat::q4f16_gemv<K,N,R,S,MODE,false,half>(x,w,s,nullptr,nullptr,o); }
// TVM's kernel as generated for Llama-2-7B (n = 11008), generalised to n
__global__ void __launch_bounds__(1024) tvm_silu(half* __restrict__ out, const half* __restrict__ lv, int n) {
  int i = blockIdx.x * 1024 + threadIdx.x;
  if (i < n) out[i] = ((lv[i] * (__float2half_rn(1.f) / (__float2half_rn(1.f) + hexp((__float2half_rn(0.f) - lv[i]))))) * lv[i + n]);
}
cudaStream_t st;
template<typename F> float tgraph(F body){ cudaGraph_t gr; cudaGraphExec_t ge; CK(cudaStreamBeginCapture(st,cudaStreamCaptureModeGlobal)); body(); CK(cudaStreamEndCapture(st,&gr)); CK(cudaGraphInstantiate(&ge,gr,0));
  for(int i=0;i<3;i++) cudaGraphLaunch(ge,st); cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); float best=1e9;
  for(int r=0;r<7;r++){ cudaEventRecord(a,st); for(int i=0;i<10;i++) cudaGraphLaunch(ge,st); cudaEventRecord(b,st); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms,a,b); best=fminf(best,ms/10);} CK(cudaGetLastError()); CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(gr)); return best*1000.f/L; }
template<int K,int N,int S> void run(const char* name){
  std::mt19937 rng(7); size_t wn=(size_t)N*K/8, sn=(size_t)N*K/32; uint32_t* w; half *s,*x,*o1,*o2,*o3;
  CK(cudaMalloc(&w,wn*4*L)); CK(cudaMalloc(&s,sn*2*L)); CK(cudaMalloc(&x,K*2)); CK(cudaMalloc(&o1,N*2)); CK(cudaMalloc(&o2,N*2)); CK(cudaMalloc(&o3,N*2));
  std::vector<uint32_t> hw(wn*L); for(auto& v:hw) v=rng(); CK(cudaMemcpy(w,hw.data(),hw.size()*4,cudaMemcpyHostToDevice));
  std::vector<half> hs(sn*L); for(auto& v:hs) v=__float2half(0.004f*(1+rng()%7)); CK(cudaMemcpy(s,hs.data(),hs.size()*2,cudaMemcpyHostToDevice));
  std::vector<half> hx(K); for(auto& v:hx) v=__float2half(((int)(rng()%200)-100)/100.f); CK(cudaMemcpy(x,hx.data(),K*2,cudaMemcpyHostToDevice));
  constexpr int R=4, W=4; int grid=N/(R*W/S); int n=N/2, sblocks=(n+1023)/1024;
  g4<K,N,R,S,1><<<grid,dim3(32,W)>>>(x,w,s,o1); tvm_silu<<<sblocks,1024>>>(o2,o1,n); g4<K,N,R,S,3><<<grid,dim3(32,W)>>>(x,w,s,o3); CK(cudaDeviceSynchronize());
  std::vector<half> a(n), b(n); CK(cudaMemcpy(a.data(),o2,n*2,cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(),o3,n*2,cudaMemcpyDeviceToHost));
  int diff=0; float amax=0; for(int i=0;i<n;i++){ unsigned short ua=*(unsigned short*)&a[i], ub=*(unsigned short*)&b[i]; diff += ua!=ub; amax=fmaxf(amax,fabsf(__half2float(a[i]))); }
  float t2=tgraph([&]{ for(int l=0;l<L;l++){ g4<K,N,R,S,1><<<grid,dim3(32,W),0,st>>>(x,w+wn*l,s+sn*l,o1); tvm_silu<<<sblocks,1024,0,st>>>(o2,o1,n);} });
  float t1=tgraph([&]{ for(int l=0;l<L;l++) g4<K,N,R,S,1><<<grid,dim3(32,W),0,st>>>(x,w+wn*l,s+sn*l,o1); });
  float t3=tgraph([&]{ for(int l=0;l<L;l++) g4<K,N,R,S,3><<<grid,dim3(32,W),0,st>>>(x,w+wn*l,s+sn*l,o3); });
  printf("%-8s K=%5d N=%6d: GEMV %.2f us, GEMV + silu kernel %.2f us, fused %.2f us; outputs differing in bits: %d of %d (|max| %.3g)\n", name, K, N, t1, t2, t3, diff, n, amax);
  cudaFree(w); cudaFree(s); cudaFree(x); cudaFree(o1); cudaFree(o2); cudaFree(o3); }
int main(){ CK(cudaStreamCreate(&st)); run<4096,22016,4>("7B"); run<2048,22016,2>("3B"); run<896,9728,1>("0.5B"); return 0; }
