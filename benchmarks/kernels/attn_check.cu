// llmchat::prefill_attention against a double-precision host reference (outputs and lse), and its
// time on prompt shapes.
// Build (any machine with nvcc):  nvcc -arch=sm_90 -O3 -std=c++17 -o attn_check attn_check.cu
// Run on the GPU machine: ./attn_check   (see benchmarks/kernels/README.md)
#include "../../app/inference/pipelines/cuda_kernels.cu"
#include <cstdio>
#include <vector>
#include <cmath>
#include <random>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("ERR %s line %d: %s\n",#x,__LINE__,cudaGetErrorString(e)); exit(1);}}while(0)
template<int HQ,int HK,int D> __global__ void __launch_bounds__(128) kern(const half* q,const int* qi,const half* k,const half* v,const int* ki,half* o,float* lse,int batch,int causal,float sm){
  llmchat::prefill_attention<HQ,HK,D>(q,qi,k,v,ki,o,lse,batch,causal,0,sm);
}
template<int HQ,int HK,int D> void run(std::vector<int> ql, std::vector<int> kl, int causal, bool timeit){
  int B=ql.size(); std::vector<int> qi(B+1,0), ki(B+1,0); for(int b=0;b<B;b++){qi[b+1]=qi[b]+ql[b]; ki[b+1]=ki[b]+kl[b];}
  int TQ=qi[B], TK=ki[B]; std::mt19937 rng(1); std::normal_distribution<float> nd(0.f,1.f);
  std::vector<half> hq((size_t)TQ*HQ*D), hk((size_t)TK*HK*D), hv((size_t)TK*HK*D);
  for(auto& x:hq) x=__float2half(nd(rng)); for(auto& x:hk) x=__float2half(nd(rng)); for(auto& x:hv) x=__float2half(nd(rng));
  half *dq,*dk,*dv,*dout; float* dl; int *dqi,*dki;
  CK(cudaMalloc(&dq,hq.size()*2)); CK(cudaMalloc(&dk,hk.size()*2)); CK(cudaMalloc(&dv,hv.size()*2)); CK(cudaMalloc(&dout,hq.size()*2)); CK(cudaMalloc(&dl,(size_t)TQ*HQ*4));
  CK(cudaMalloc(&dqi,(B+1)*4)); CK(cudaMalloc(&dki,(B+1)*4));
  cudaMemcpy(dq,hq.data(),hq.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(dk,hk.data(),hk.size()*2,cudaMemcpyHostToDevice); cudaMemcpy(dv,hv.data(),hv.size()*2,cudaMemcpyHostToDevice);
  cudaMemcpy(dqi,qi.data(),(B+1)*4,cudaMemcpyHostToDevice); cudaMemcpy(dki,ki.data(),(B+1)*4,cudaMemcpyHostToDevice);
  float sm=1.f/sqrtf((float)D); dim3 grid((TQ+63)/64+B, HQ), blk(32,4);
  kern<HQ,HK,D><<<grid,blk>>>(dq,dqi,dk,dv,dki,dout,dl,B,causal,sm); CK(cudaDeviceSynchronize());
  std::vector<half> ho(hq.size()); std::vector<float> hl((size_t)TQ*HQ);
  cudaMemcpy(ho.data(),dout,ho.size()*2,cudaMemcpyDeviceToHost); cudaMemcpy(hl.data(),dl,hl.size()*4,cudaMemcpyDeviceToHost);
  double maxerr=0, maxref=0, lseerr=0; 
  for(int b=0;b<B;b++) for(int i=0;i<ql[b];i++) for(int h=0;h<HQ;h++){ int kh=h/(HQ/HK);
    std::vector<double> s(kl[b]); double mx=-1e300; int lim = causal? kl[b]-ql[b]+i+1 : kl[b];
    for(int j=0;j<lim;j++){ double a=0; for(int d=0;d<D;d++) a+=(double)__half2float(hq[((size_t)(qi[b]+i)*HQ+h)*D+d])*__half2float(hk[((size_t)(ki[b]+j)*HK+kh)*D+d]); s[j]=a*sm; mx=fmax(mx,s[j]); }
    double den=0; for(int j=0;j<lim;j++){ s[j]=exp(s[j]-mx); den+=s[j]; }
    for(int d=0;d<D;d++){ double acc=0; for(int j=0;j<lim;j++) acc+=s[j]*__half2float(hv[((size_t)(ki[b]+j)*HK+kh)*D+d]); acc/=den;
      double got=__half2float(ho[((size_t)(qi[b]+i)*HQ+h)*D+d]); maxerr=fmax(maxerr,fabs(got-acc)); maxref=fmax(maxref,fabs(acc)); }
    double lse_ref=(mx+log(den))/log(2.0); lseerr=fmax(lseerr,fabs(lse_ref-hl[(size_t)(qi[b]+i)*HQ+h]));
  }
  printf("HQ%d HK%d D%d B%d causal%d q0=%d kv0=%d: max abs err %.3e (max |ref| %.3f), lse err %.3e\n",HQ,HK,D,B,causal,ql[0],kl[0],maxerr,maxref,lseerr);
  if(timeit){ cudaEvent_t a,b2; cudaEventCreate(&a); cudaEventCreate(&b2); cudaEventRecord(a); for(int i=0;i<50;i++) kern<HQ,HK,D><<<grid,blk>>>(dq,dqi,dk,dv,dki,dout,dl,B,causal,sm); cudaEventRecord(b2); cudaEventSynchronize(b2); float ms; cudaEventElapsedTime(&ms,a,b2);
    double fl=0; for(int b2_=0;b2_<B;b2_++) fl+=4.0*HQ*D*(double)ql[b2_]*kl[b2_]*(causal?0.5:1.0); printf("  time %.1f us, %.1f TFLOPS\n",ms/50*1000, fl/(ms/50*1e-3)/1e12);}
  cudaFree(dq);cudaFree(dk);cudaFree(dv);cudaFree(dout);cudaFree(dl);cudaFree(dqi);cudaFree(dki);
}
int main(){
  run<32,32,128>({150},{150},1,false);
  run<32,32,128>({70,513},{200,513},1,false);
  run<32,32,128>({40},{40},0,false);
  run<14,2,64>({150},{150},1,false);
  run<14,2,64>({1,100},{37,260},1,false);
  run<32,32,128>({512},{512},1,true);
  run<16,2,128>({512},{512},1,true);
  run<14,2,64>({512},{512},1,true);
  return 0;
}
