// Shared by the decode attention checks (decode_attn_check.cu, gqa_decode_check.cu): CK, the CUDA
// graph timer (32 layers per graph, best of 7 x 10 launches, us per layer) and one sequence of `len`
// keys in shuffled pages for 32 layers, with a double-precision host reference of layer 0.
#pragma once
#include <cstdio>
#include <vector>
#include <cmath>
#include <random>
#include <algorithm>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
constexpr int L = 32, PAGE = 16;
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
