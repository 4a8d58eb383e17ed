#!/bin/bash
# session 18 call C: where a Llama-3-8B prompt chunk's time goes: ncu's kernel durations over a
# 2,048-token prompt (gpu_decode.py depth, 5cb5694's library with the mma.sync GEMM)
set -u
O=$OUT
echo "$COMMIT_NOTE" > $O/commit.txt
OUTDIR=$O/env . benchmarks/device_env.sh
NCU=/usr/local/cuda/bin/ncu
timeout 330 $NCU --metrics gpu__time_duration.sum --csv --page raw --launch-count 6000 --log-file $O/ncu.csv \
  python3 benchmarks/gpu_decode.py depth --cache scratch/s18/mma --presets llama3-8b --plain "" --context 8448 \
  --prompts 2048 --depths 0 --gen 2 --repeats 1 --out $O/p.json > $O/run.log 2>&1
stamp "ncu rc=$?"; tail -5 $O/run.log; wc -l $O/ncu.csv; head -c 600 $O/ncu.csv
gzip $O/ncu.csv
stamp done
