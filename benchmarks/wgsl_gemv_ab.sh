#!/bin/bash
# A/B of WGSL decode-GEMV rule sets inside whole models (issue #15): compile here, run on the GPU.
#
#   bash benchmarks/wgsl_gemv_ab.sh compile DIR [SET ...]   # here (TVM compiler): DIR/SET/ libraries
#   bash benchmarks/wgsl_gemv_ab.sh run DIR [SET ...]       # GPU machine: decode loop ms/step and the
#                                                           # GPU profile (µs per kernel) of each set
#
# A SET names an LLMCHAT_WGSL_GEMV value below (the rule list is part of the compile cache's key, so
# the run sets the same value). PRESETS (default qwen2.5-3b,llama2-7b), ARCH (default the H200's
# WGSL profile) and CTX (the context window, default 2048) as for benchmarks/gpu_decode.py. On the
# GPU machine carry .whl, .gl, scratch/whl-hub and DIR; the run writes loop_SET.log / gpuprof_SET.log and all.tgz into $OUT and
# stops starting new sets after BUDGET_S seconds (default 480). BENCH=1: only the bench protocol
# (gpu_decode.py run: decode tok/s, 1-token prompt, 512 tokens, best of 3) of each set.
set -u
cd "$(dirname "$0")/.."
CMD=${1:?compile or run}; DIR=${2:?a folder for the libraries}; shift 2
PRESETS=${PRESETS:-qwen2.5-3b,llama2-7b}
ARCH=${ARCH:-wgsl-f16-wg49152-t256}
OLD="t8-b256-l16-u4-mb128,t8-b256-l4-u4-mb128-nopad-k8192-n4096"  # the DecodeGEMV layouts
WIDE="q4-r4-l32-t256-dp4a-nmin16384-kmax8191"                      # gate_up and the logits
rules() {  # the set's LLMCHAT_WGSL_GEMV value; sets after "old" set other switches (env())
  case $1 in
    cur|fuse|nofuse|norm|silu|both|pre2|pre4|pre8|s0|v2all|s0all|atv1|attvm|h1|h2|h4|h2s512|h0|s64|s256|wg64|wg256|wg512|tvmmany|raoff|raon|q8|q8ra|noq8|q8s|r8|l16|q8s16|q8n|q8nr4|q8nr1|k0|k4|k8|k16|k8s0|k8s512|k8wg256|k16wg256|k16wg512|k32|mw128|mw512|mw1024|q8ns|nr2p|nr1|nr1p|nr4l64|nr8l128|gtiled|gf16) echo "";;  # the product's rules
    dn1) echo "q4-auto,q4-r1-l32-t256-dp4a,$OLD";;                  # down projections: 8 rows a workgroup
    dn2) echo "q4-auto,q4-r1-l64-t256-dp4a,$OLD";;                  # ... 4 rows, 64 lanes a row
    dn2pf) echo "q4-auto,q4-r1-l64-t256-dp4a-pf,$OLD";;             # ... the weights loaded a step ahead
    all8) echo "$WIDE,q4-r1-l32-t256-dp4a,$OLD";;                   # every GEMV under 16,384 rows: 8 rows
    all4) echo "$WIDE,q4-r1-l64-t256-dp4a,$OLD";;                   # ... 4 rows
    all4pf) echo "${WIDE/dp4a/dp4a-pf},q4-r1-l64-t256-dp4a-pf,$OLD";;
    all16) echo "$WIDE,q4-r2-l32-t256-dp4a,$OLD";;                  # ... 16 rows
    autopf) echo "q4-r4-l32-t256-dp4a-pf-kmax8191,$OLD";;           # q4-auto's layout, loads ahead
    old) echo "$OLD";;                                              # before the int8 kernel
    *) echo "unknown set $1" >&2; return 1;;
  esac
}
env_of() {  # other kernel switches of a set
  case $1 in
    fuse) echo "LLMCHAT_WGSL_FUSION=on";;                           # RMSNorm / SiLU grafted into the GEMVs
    nofuse) echo "LLMCHAT_WGSL_FUSION=off";;                        # RMSNorm / SiLU kernels of their own
    norm) echo "LLMCHAT_WGSL_FUSION=int8-norm";;                    # the int8 GEMVs take the RMSNorm only
    silu) echo "LLMCHAT_WGSL_FUSION=int8-silu";;                    # ... the SiLU gate only
    both) echo "LLMCHAT_WGSL_FUSION=int8";;                         # ... both, whatever the row
    pre2|pre4|pre8) echo "LLMCHAT_WGSL_Q4_PRELOAD=${1#pre}";;       # q4-auto: steps loaded before the staging
    s0) echo "LLMCHAT_WGSL_ATTENTION=split-v2-single0";;            # attention: chunks from the first page
    v2all) echo "LLMCHAT_WGSL_ATTENTION=split-v2-all";;             # attention v2 for 32 KV heads too
    s0all) echo "LLMCHAT_WGSL_ATTENTION=split-v2-single0-all";;
    atv1) echo "LLMCHAT_WGSL_ATTENTION=split-v1";;                  # attention: the first split kernel
    attvm) echo "LLMCHAT_WGSL_ATTENTION=tvm";;                      # attention: TVM's kernel
    h1|h2|h4) echo "LLMCHAT_WGSL_ATTENTION=split-v2-heads${1#h}";;  # attention v2: N query heads a workgroup
    h2s512) echo "LLMCHAT_WGSL_ATTENTION=split-v2-heads2-single512";; # ... one chunk up to 512 keys
    h0) echo "LLMCHAT_WGSL_ATTENTION=split-v2-heads0";;              # ... all query heads of a KV head
    s64|s256) echo "LLMCHAT_WGSL_ATTENTION=split-v2-single${1#s}";;  # ... one chunk up to N keys
    wg64|wg256|wg512) echo "LLMCHAT_WGSL_ATTENTION=split-v2-wg${1#wg}";; # ... N workgroups at long contexts
    tvmmany) echo "LLMCHAT_WGSL_ATTENTION=split-v2-tvmmany";;        # ... TVM's kernel from 16 KV heads
    raoff) echo "LLMCHAT_WGSL_ROPE_APPEND=off";;                     # RoPE + append: TVM's two launches
    raon) echo "LLMCHAT_WGSL_ROPE_APPEND=on";;                       # ... inside the attention, every head_dim
    q8) echo "LLMCHAT_WGSL_FUSION=int8-q8";;                         # long rows' norm writes the int8 vector
    q8ra) echo "LLMCHAT_WGSL_FUSION=int8-q8 LLMCHAT_WGSL_ROPE_APPEND=on";; # ... and RoPE + append fused
    noq8) echo "LLMCHAT_WGSL_FUSION=int8-noq8";;                     # the default without the quantize-once
    q8s) echo "LLMCHAT_WGSL_FUSION=int8-q8s";;                       # gate_up writes the down projection's int8 vector (the default since session 16)
    r8) echo "LLMCHAT_WGSL_GATE_LAYOUT=r8";;                          # gate_up: 8 rows a set (float16 out)
    l16) echo "LLMCHAT_WGSL_GATE_LAYOUT=l16";;                        # gate_up: 4 rows a set of 16 lanes
    q8s16) echo "LLMCHAT_WGSL_FUSION=int8-q8s LLMCHAT_WGSL_GATE_LAYOUT=l16";; # q8s with 16-lane sets
    q8n) echo "LLMCHAT_WGSL_FUSION=int8-q8n";;                       # o / down write the next norm's int8 vector: no norm launch
    q8nr4|q8nr1) echo "LLMCHAT_WGSL_FUSION=int8-q8n LLMCHAT_WGSL_NORM_OUT_LAYOUT=${1#q8n}";; # ... their layout
    k4|k8|k16) echo "LLMCHAT_WGSL_ATTENTION=split-v2-key${1#k}";;     # attention, one query head a KV head: keys in parallel, N threads a key
    k8s0|k8s512) echo "LLMCHAT_WGSL_ATTENTION=split-v2-key8-single${1#k8s}";; # ... chunks from the first page / one chunk up to 512 keys
    k8wg256) echo "LLMCHAT_WGSL_ATTENTION=split-v2-key8-wg256";;      # ... 8 chunks a KV head at long contexts
    k16wg256|k16wg512) echo "LLMCHAT_WGSL_ATTENTION=split-v2-key16-wg${1#k16wg}";; # ... 16 threads a key (the default), 8 / 16 chunks a KV head
    k0) echo "LLMCHAT_WGSL_ATTENTION=split-v2-key0";;                # ... v2's kernel (the default before session 20)
    k32) echo "LLMCHAT_WGSL_ATTENTION=split-v2-key32";;               # ... 32 threads a key
    mw128|mw512|mw1024) echo "LLMCHAT_WGSL_MIN_WORKGROUPS=${1#mw}";;  # int8 GEMVs: the most rows a set that still give N workgroups
    q8ns) echo "LLMCHAT_WGSL_FUSION=int8-q8ns";;                      # norms folded only for rows up to 2,048 (the default before session 21)
    nr2p|nr1|nr1p|nr4l64|nr8l128) echo "LLMCHAT_WGSL_NORM_OUT_LAYOUT=${1#n}";; # a GEMV writing a norm's vector: its layout (p: several threads quantize)
    gtiled) echo "LLMCHAT_WGSL_GEMM=tiled";;                          # prompt GEMMs: the scheduled GEMM for q4f16_1 too (the default before session 23)
    gf16) echo "LLMCHAT_WGSL_GEMM=f16";;                              # prompt GEMMs: a K step's products and sums in fp16 (session 24, unmeasured)
  esac
}
SETS=${*:-cur dn1 dn2 dn2pf all8 all4 all4pf all16 autopf}
use() {
  local r e; r=$(rules "$1") || exit 2
  unset LLMCHAT_WGSL_MIN_WORKGROUPS LLMCHAT_WGSL_GEMV LLMCHAT_WGSL_FUSION LLMCHAT_WGSL_ATTENTION LLMCHAT_WGSL_Q4_PRELOAD LLMCHAT_WGSL_ROPE_APPEND LLMCHAT_WGSL_NORM_OUT_LAYOUT LLMCHAT_WGSL_GATE_LAYOUT LLMCHAT_WGSL_GEMM
  if [ -n "$r" ]; then export LLMCHAT_WGSL_GEMV=$r; fi
  for e in $(env_of "$1"); do export "${e?}"; done
}

if [ "$CMD" = compile ]; then
  PY=${PY:-.venv/bin/python}
  mkdir -p "$DIR"
  for s in $SETS; do
    use "$s"
    "$PY" benchmarks/gpu_decode.py compile --cache "$DIR/$s" --arch "$ARCH" --presets "$PRESETS" --plain "" \
      --context "${CTX:-2048}" > "$DIR/compile_$s.log" 2>&1
    echo "$s rc=$?"
    rm -rf "$DIR/$s/tmp"
  done
  du -sh "$DIR"
  exit 0
fi
[ "$CMD" = run ] || { echo "compile or run" >&2; exit 2; }
. benchmarks/device_env.sh || exit 1
O=$OUTDIR
for s in $SETS; do
  [ $(( $(date +%s) - _device_env_start )) -gt "${BUDGET_S:-480}" ] && { stamp "out of time before $s"; break; }
  use "$s"
  if [ -n "${BENCH:-}" ]; then  # the bench protocol only: decode tok/s of each preset
    timeout 120 python3 benchmarks/gpu_decode.py run --backend vulkan --cache "$DIR/$s" --presets "$PRESETS" \
      --plain "" --check-steps 8 --out "$O/bench_$s.json" > "$O/bench_$s.log" 2>&1
    stamp "bench $s rc=$?: $(grep -o '"decode_tok_s": [0-9.]*\|"prefill_tok_s": [0-9.]*' "$O/bench_$s.log" | paste -sd' ')"
    continue
  fi
  timeout 60 python3 benchmarks/vulkan_profile.py --cache "$DIR/$s" --presets "$PRESETS" --steps 64 > "$O/loop_$s.log" 2>&1
  stamp "loop $s rc=$?: $(grep -o '"preset": "[^"]*", "steps": 64, "ms_per_step": [0-9.]*' "$O/loop_$s.log" | paste -sd' ')"
  LLMCHAT_WEBGPU_PROFILE=1 timeout 60 python3 benchmarks/vulkan_profile.py --cache "$DIR/$s" --presets "$PRESETS" \
    --steps 64 > "$O/gpuprof_$s.log" 2>&1
  stamp "gpu profile $s rc=$?"
  python3 - "$O/gpuprof_$s.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if '"kernels"' in line:
        d = json.loads(line)
        top = " ".join(f"{k['name'][:24]}:{k['us_each']}" for k in d["kernels"][:6])
        print(f"  {d['preset']} GPU {d['gpu_ms_per_step']} ms/step; {top}")
PY
done
(cd "$O" && tar czf all.tgz ./*.log ./*.txt ./*.json 2>/dev/null)
stamp end
