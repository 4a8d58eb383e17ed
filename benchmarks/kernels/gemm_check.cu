// llmchat::q4f16_gemm (prompt matmuls) against the previous kernel (old_kernels.cu: see README.md)
// and a double-precision host reference on sampled outputs, and both kernels' times.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o gemm_check gemm_check.cu
// Run on the GPU machine: ./gemm_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include "old_kernels.cu"
#include <cstdio>
#include <vector>
#include <random>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
template<int K,int N,int BM> __global__ void __launch_bounds__(128) knew(const half* x,const uint32_t* w,const half* s,const half* r,half* o,int M){ llmchat::q4f16_gemm<K,N,BM,2,false,half>(x,w,s,nullptr,r,o,M); }
template<int K,int N> __global__ void __launch_bounds__(128) kold(const half* x,const uint32_t* w,const half* s,const half* r,half* o,int M){ llmchat_old::q4f16_gemm<K,N,2,false,half>(x,w,s,nullptr,r,o,M); }
template<int K,int N,int BM=128> void run(int M, const char* name){
  std::mt19937 rng(3); std::uniform_int_distribution<uint32_t> ui; std::normal_distribution<float> nd(0.f,1.f);
  std::vector<uint32_t> hw((size_t)N*K/8); for(auto& v:hw) v=ui(rng);
  std::vector<half> hs((size_t)N*K/32), hx((size_t)M*K), hr((size_t)M*N);
  for(auto& v:hs) v=__float2half(0.02f*(0.5f+std::fabs(nd(rng)))); for(auto& v:hx) v=__float2half(nd(rng)); for(auto& v:hr) v=__float2half(nd(rng));
  uint32_t* dw; half *ds,*dx,*dr,*d1,*d2;
  CK(cudaMalloc(&dw,hw.size()*4)); CK(cudaMalloc(&ds,hs.size()*2)); CK(cudaMalloc(&dx,hx.size()*2)); CK(cudaMalloc(&dr,hr.size()*2)); CK(cudaMalloc(&d1,hr.size()*2)); CK(cudaMalloc(&d2,hr.size()*2));
  cudaMemcpy(dw,hw.data(),hw.size()*4,cudaMemcpyHostToDevice); cudaMemcpy(ds,hs.data(),hs.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(dx,hx.data(),hx.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(dr,hr.data(),hr.size()*2,cudaMemcpyHostToDevice);
  dim3 gn(N/64,(M+BM-1)/BM), go(N/64,(M+63)/64);
  knew<K,N,BM><<<gn,128>>>(dx,dw,ds,dr,d1,M); kold<K,N><<<go,128>>>(dx,dw,ds,dr,d2,M); CK(cudaDeviceSynchronize());
  std::vector<half> o1(hr.size()), o2(hr.size()); cudaMemcpy(o1.data(),d1,o1.size()*2,cudaMemcpyDeviceToHost); cudaMemcpy(o2.data(),d2,o2.size()*2,cudaMemcpyDeviceToHost);
  double maxd=0, maxe=0, maxref=0;
  for(size_t i=0;i<o1.size();i++) maxd=fmax(maxd,fabs((double)__half2float(o1[i])-__half2float(o2[i])));
  for(int t=0;t<200;t++){ int m=ui(rng)%M, n=ui(rng)%N; double acc=0;
    for(int k=0;k<K;k++){ uint32_t word=hw[(size_t)n*(K/8)+k/8]; int nib=(word>>(4*(k%8)))&15; double wv=(double)__half2float(__float2half((nib-7)*__half2float(hs[(size_t)n*(K/32)+k/32]))); acc+=wv*__half2float(hx[(size_t)m*K+k]); }
    double ref=__half2float(hr[(size_t)m*N+n])+acc; maxe=fmax(maxe,fabs(ref-__half2float(o1[(size_t)m*N+n]))); maxref=fmax(maxref,fabs(ref)); }
  cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); float tn, to;
  cudaEventRecord(a); for(int i=0;i<20;i++) knew<K,N,BM><<<gn,128>>>(dx,dw,ds,dr,d1,M); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&tn,a,b);
  cudaEventRecord(a); for(int i=0;i<20;i++) kold<K,N><<<go,128>>>(dx,dw,ds,dr,d2,M); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&to,a,b);
  double fl=2.0*M*N*K; CK(cudaGetLastError());
  printf("%s M=%d K=%d N=%d: new %.1f us (%.0f TF) old %.1f us (%.0f TF) | new-old max %.3g, new vs host max err %.3g (|ref| %.3g)\n",name,M,K,N,tn/20*1e3,fl/(tn/20*1e-3)/1e12,to/20*1e3,fl/(to/20*1e-3)/1e12,maxd,maxe,maxref);
  cudaFree(dw);cudaFree(ds);cudaFree(dx);cudaFree(dr);cudaFree(d1);cudaFree(d2);
}
int main(){
  run<4096,12288>(512,"qkv"); run<4096,4096>(512,"o"); run<4096,22016>(512,"gu"); run<11008,4096>(512,"down");
  run<4096,12288>(150,"qkv"); run<896,1152,64>(77,"q05/64"); run<4864,896,64>(512,"down05/64"); run<2048,2560,64>(512,"qkv3b/64"); run<2048,2048,64>(512,"o3b/64"); run<2048,22016>(512,"gu3b"); run<896,9728>(512,"gu05"); run<4096,4096,128>(1,"o M=1"); run<4096,4096,64>(1,"o M=1/64");
  return 0;
}
