// llmchat::decode_attention over TVM's paged KV layout: the sm_90 path (chunks merged inside a
// thread-block cluster, launched as TVM's runtime does: cudaLaunchKernelEx with a cluster dimension)
// and the previous kernel (prev_kernels.cu: see README.md; the chunks merged through a global
// scratch area, still the path before sm_90), against a double-precision host reference (outputs and
// lse), 32 layers in a CUDA graph, on the three benchmark shapes and contexts of 1 to 8,192 keys.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o decode_attn_check decode_attn_check.cu
// Run on the GPU machine: ./decode_attn_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include "prev_kernels.cu"
#include "decode_setup.cuh"
template<int HQ,int HK,int D,int NC,int W> __global__ void __launch_bounds__(W*32) knew(const half* q,const half* pages,const int* ip,const int* vals,const int* ll,half* o,float* lse,float sm){
  llmchat::decode_attention<HQ,HK,D,PAGE,NC,1,W,true>(q,pages,ip,vals,ll,o,lse,sm,1,0); }
template<int HQ,int HK,int D,int NC,int GH> __global__ void __launch_bounds__(128) kprev(const half* q,const half* pages,const int* ip,const int* vals,const int* ll,half* o,float* lse,float sm){
  llmchat_prev::decode_attention<HQ,HK,D,PAGE,NC,GH>(q,pages,ip,vals,ll,o,lse,sm,1,0); }
// the cluster path, NC chunks per head as cuda_attention.cluster_chunks picks them on the H200
template<int HQ,int HK,int D,int NC> void tnew(Setup<HQ,HK,D>& s, float sm){
  auto k = knew<HQ,HK,D,NC,8>;
  if (NC > 8) CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));  // as TVM's runtime does
  auto go=[&](int l, cudaStream_t stream){ cudaLaunchConfig_t c = {}; c.gridDim=dim3(NC,HQ,1); c.blockDim=dim3(32,8); c.stream=stream;
    cudaLaunchAttribute at[1]; at[0].id=cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x=NC; at[0].val.clusterDim.y=1; at[0].val.clusterDim.z=1; c.attrs=at; c.numAttrs=1;
    CK(cudaLaunchKernelEx(&c, k, (const half*)(s.q+(size_t)HQ*D*l),(const half*)(s.p+s.per()*l),(const int*)s.ip,(const int*)s.vl,(const int*)s.ll,s.o+(size_t)HQ*D*l,s.lse+HQ*l,sm)); };
  go(0, 0); CK(cudaDeviceSynchronize()); double e=s.check(sm);
  float t=tgraph([&]{ for(int l=0;l<L;l++) go(l, st); });
  printf("  cluster (%2d chunks, 8 warps): %6.2f us, max err %.2g\n", NC, t, e); }
template<int HQ,int HK,int D,int NC,int GH> void tprev(Setup<HQ,HK,D>& s, float sm){
  dim3 g(NC,HQ/GH,1), b(32,4);
  kprev<HQ,HK,D,NC,GH><<<g,b>>>(s.q,s.p,s.ip,s.vl,s.ll,s.o,s.lse,sm); CK(cudaDeviceSynchronize()); double e=s.check(sm);
  float t=tgraph([&]{ for(int l=0;l<L;l++) kprev<HQ,HK,D,NC,GH><<<g,b,0,st>>>(s.q+(size_t)HQ*D*l,s.p+s.per()*l,s.ip,s.vl,s.ll,s.o+(size_t)HQ*D*l,s.lse+HQ*l,sm); });
  printf("  previous (%2d chunks, global merge): %6.2f us, max err %.2g\n", NC, t, e); }
template<int HQ,int HK,int D,int NCNEW,int NCPREV,int GHPREV> void shape(const char* name){
  const float sm=1.f/sqrtf((float)D);
  for(int len : {1, 16, 266, 1024, 4096, 8192}){
    Setup<HQ,HK,D> s(len);
    printf("%s, %d keys\n", name, len);
    tnew<HQ,HK,D,NCNEW>(s,sm); tprev<HQ,HK,D,NCPREV,GHPREV>(s,sm);
  }
}
int main(){ CK(cudaStreamCreate(&st));
  shape<32,32,128, 8,8,1>("Llama-2-7B (32 heads, 32 kv heads, 128)");
  shape<16,2,128, 16,32,2>("Qwen2.5-3B (16, 2, 128)");
  shape<14,2,64, 16,32,1>("Qwen2.5-0.5B (14, 2, 64)");
  return 0; }
