// llmchat::decode_attention over TVM's paged KV layout: the sm_90 path (chunks merged inside a
// thread-block cluster, launched as TVM's runtime does: cudaLaunchKernelEx with a cluster dimension)
// and the previous kernel (prev_kernels.cu: see README.md; the chunks merged through a global
// scratch area, still the path before sm_90), against a double-precision host reference (outputs and
// lse), 32 layers in a CUDA graph, on the three benchmark shapes and contexts of 1 to 8,192 keys.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o decode_attn_check decode_attn_check.cu
// Run on the GPU machine: ./decode_attn_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include "prev_kernels.cu"
#include <cstdio>
#include <vector>
#include <cmath>
#include <random>
#include <algorithm>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
constexpr int L = 32, PAGE = 16;
template<int HQ,int HK,int D,int NC,int W> __global__ void __launch_bounds__(W*32) knew(const half* q,const half* pages,const int* ip,const int* vals,const int* ll,half* o,float* lse,float sm){
  llmchat::decode_attention<HQ,HK,D,PAGE,NC,1,W,true>(q,pages,ip,vals,ll,o,lse,sm,1,0); }
template<int HQ,int HK,int D,int NC,int GH> __global__ void __launch_bounds__(128) kprev(const half* q,const half* pages,const int* ip,const int* vals,const int* ll,half* o,float* lse,float sm){
  llmchat_prev::decode_attention<HQ,HK,D,PAGE,NC,GH>(q,pages,ip,vals,ll,o,lse,sm,1,0); }
cudaStream_t st;
template<typename F> float tgraph(F body){ cudaGraph_t g; cudaGraphExec_t ge; CK(cudaStreamBeginCapture(st,cudaStreamCaptureModeGlobal)); body(); CK(cudaStreamEndCapture(st,&g)); CK(cudaGraphInstantiate(&ge,g,0));
  for(int i=0;i<3;i++) cudaGraphLaunch(ge,st); cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b); float best=1e9;
  for(int r=0;r<7;r++){ cudaEventRecord(a,st); for(int i=0;i<10;i++) cudaGraphLaunch(ge,st); cudaEventRecord(b,st); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms,a,b); best=fminf(best,ms/10);} CK(cudaGetLastError()); CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g)); return best*1000.f/L; }
// one sequence of `len` keys in shuffled pages, 32 layers (each its own pages and query)
template<int HQ,int HK,int D> struct Setup {
  int len, np, pages_total; std::vector<half> hq, hp; std::vector<int> vals; half *q, *p, *o; float* lse; int *ip, *vl, *ll;
  explicit Setup(int len_): len(len_) { np=(len+PAGE-1)/PAGE; pages_total=np+3; std::mt19937 rng(len); std::normal_distribution<float> nd(0.f,1.f);
    hq.resize((size_t)HQ*D); for(auto& x:hq) x=__float2half(nd(rng));
    hp.resize(per()); for(auto& x:hp) x=__float2half(nd(rng));
    vals.resize(pages_total); for(int i=0;i<pages_total;i++) vals[i]=i; std::shuffle(vals.begin(),vals.end(),rng); vals.resize(np);
    std::vector<int> hip={0,np}, hll={len-(np-1)*PAGE};
    CK(cudaMalloc(&q,hq.size()*2*L)); CK(cudaMalloc(&p,per()*2*L)); CK(cudaMalloc(&o,(size_t)HQ*D*2*L)); CK(cudaMalloc(&lse,HQ*4*L));
    CK(cudaMalloc(&ip,8)); CK(cudaMalloc(&vl,np*4)); CK(cudaMalloc(&ll,4));
    for(int l=0;l<L;l++){ CK(cudaMemcpy(q+hq.size()*l,hq.data(),hq.size()*2,cudaMemcpyHostToDevice)); CK(cudaMemcpy(p+per()*l,hp.data(),per()*2,cudaMemcpyHostToDevice)); }
    CK(cudaMemcpy(ip,hip.data(),8,cudaMemcpyHostToDevice)); CK(cudaMemcpy(vl,vals.data(),np*4,cudaMemcpyHostToDevice)); CK(cudaMemcpy(ll,hll.data(),4,cudaMemcpyHostToDevice)); }
  ~Setup(){ cudaFree(q); cudaFree(p); cudaFree(o); cudaFree(lse); cudaFree(ip); cudaFree(vl); cudaFree(ll); }
  size_t per() const { return (size_t)pages_total*2*HK*PAGE*D; }
  double check(float sm) {  // layer 0's outputs and lse (log2 domain) against the host
    std::vector<half> ho((size_t)HQ*D); std::vector<float> hl(HQ); CK(cudaMemcpy(ho.data(),o,ho.size()*2,cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hl.data(),lse,HQ*4,cudaMemcpyDeviceToHost));
    double err=0; for(int h=0;h<HQ;h++){ int kh=h/(HQ/HK); std::vector<double> s(len); double m=-1e30;
      for(int t=0;t<len;t++){ int pg=vals[t/PAGE], sl=t%PAGE; double a=0; for(int d=0;d<D;d++) a+=(double)__half2float(hq[h*D+d])*__half2float(hp[(((size_t)pg*2+0)*HK+kh)*PAGE*D+sl*D+d]); s[t]=a*sm; m=std::max(m,s[t]); }
      double den=0; for(int t=0;t<len;t++){ s[t]=exp(s[t]-m); den+=s[t]; }
      for(int d=0;d<D;d++){ double a=0; for(int t=0;t<len;t++){ int pg=vals[t/PAGE], sl=t%PAGE; a+=s[t]*__half2float(hp[(((size_t)pg*2+1)*HK+kh)*PAGE*D+sl*D+d]); } err=std::max(err,fabs(a/den-__half2float(ho[h*D+d]))); }
      err=std::max(err,fabs((m+log(den))/log(2.0)-hl[h])); }
    return err; }
};
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
