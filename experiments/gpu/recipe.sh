#!/usr/bin/env bash
# The GPU recipe of docs/performance.md ("On a GPU") on one lent GPU whose image holds torch 2.11:
# the code runs from the checkout itself (lmfunc supports torch 2.11 to 2.15), and the pure-Python
# packages the image lacks (tyro, typeguard, docstring-parser) come as wheels in .whl/ when present.
#   bash experiments/gpu/recipe.sh            # from the repository root; logs go to $OUT (default ./gpu-out)
#   BUNDLE_LOGS=1 bash experiments/gpu/recipe.sh   # the same, the logs then packed into $OUT/logs.tar.gz
# Phase 1 runs the plan, the device tests, a bf16 and a TF32 training run and a one-process
# torchrun (NCCL) run side by side (their compiles share the CPU; their tok/s share the GPU).
# Phases 2 and 3 run the train-step benchmark alone: the default workload, then GPT-2 small.
# Phase 4 is the mixture-of-experts part: the deepseek-v3-tiny and moe-small presets train on cuda
# (bf16, eager; the device tests beside them), then experiments.probes.moe_vs_dense times MoE
# against dense, dropless against capacity, eager, and compiled (on torch 2.11 without dropless, which
# lmfunc refuses to compile there: README, "Which torch"), at a GPU-sized shape.
# Phase 0 records the host CPU (lscpu) and, where it has AVX-512 BF16/FP16 or AMX, runs the oneDNN
# NaN probe (experiments.probes.onednn_nan) on it. Phase 5 is the bf16 MFU of a ~1.2B model (16 layers,
# width 2048, seq 2048, vocab 50304, batch 8), func-compiled against module-compiled (autocast).
# All four can take 18 minutes, past one device call's 10: PHASES picks some, e.g.
#   PHASES="1" bash experiments/gpu/recipe.sh, then PHASES="2 3" in a second call.
set -u
OUT=${OUT:-$PWD/gpu-out}
PHASES=${PHASES:-1 2 3}
runs_phase() { [[ " $PHASES " == *" $1 "* ]]; }
mkdir -p "$OUT"
started_mark=$(mktemp)  # the logs this run writes are newer than it (BUNDLE_LOGS packs only those)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 -c "import lmfunc.train, lmfunc.plan, experiments.bench, experiments.probes.moe_vs_dense" || exit 1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    echo "cpus $(nproc)"
} > "$OUT/machine.log" 2>&1

if runs_phase 0; then
echo "phase 0 $(date +%T)"
lscpu > "$OUT/lscpu.log" 2>&1
if grep -qwE "avx512_bf16|avx512_fp16|amx_bf16" /proc/cpuinfo; then
    timeout 240 python3 -m experiments.probes.onednn_nan > "$OUT/onednn_nan.log" 2>&1
    tail -n 12 "$OUT/onednn_nan.log"
else
    echo "no AVX-512 BF16/FP16 or AMX on this host: the oneDNN NaN probe does not apply" | tee "$OUT/onednn_nan.log"
fi
grep -E "Model name|^CPU\(s\)" "$OUT/lscpu.log"
fi

if runs_phase 1; then
echo "phase 1 $(date +%T)"
timeout 240 python3 -m lmfunc.plan --precision.compute-dtype bf16 > "$OUT/plan.log" 2>&1 &
timeout 240 python3 -m pytest -q tests/test_device.py -rs -p no:cacheprovider > "$OUT/pytest.log" 2>&1 &
timeout 240 python3 -m lmfunc.train --run.device cuda --precision.compute-dtype bf16 --run.train-iters 300 \
    --run.out-dir /tmp/runs/bf16 > "$OUT/train_bf16.log" 2>&1 &
timeout 240 python3 -m lmfunc.train --run.device cuda --precision.tf32 --run.train-iters 300 \
    --run.out-dir /tmp/runs/tf32 > "$OUT/train_tf32.log" 2>&1 &
timeout 240 torchrun --nproc-per-node 1 -m lmfunc.train --run.device cuda --precision.compute-dtype bf16 \
    --run.train-iters 50 --run.out-dir /tmp/runs/torchrun > "$OUT/torchrun.log" 2>&1 &
wait
tail -n 3 "$OUT"/*.log
fi

if runs_phase 2; then
echo "phase 2 $(date +%T)"
timeout 200 python3 -m experiments.bench --device cuda --variants func-compiled module-compiled --repeats 2 \
    --steps 30 > "$OUT/bench.log" 2>&1
tail -n 12 "$OUT/bench.log"
fi

if runs_phase 3; then
echo "phase 3 $(date +%T)"
timeout 220 python3 -m experiments.bench --device cuda --variants func-compiled module-compiled --repeats 1 \
    --steps 15 --layers 12 --heads 12 --hidden 768 --seq 1024 --vocab 50304 >> "$OUT/bench.log" 2>&1
tail -n 12 "$OUT/bench.log"
fi
if runs_phase 4; then
echo "phase 4 $(date +%T)"
moe_run() {  # moe_run PRESET: 200 eager bf16 steps of the preset on cuda
    timeout 150 python3 -m lmfunc.train --preset "$1" --run.device cuda --precision.compute-dtype bf16 --run.no-compile \
        --data.seq-length 256 --run.micro-batch-size 32 --run.global-batch-size 32 --run.train-iters 200 \
        --log.log-interval 50 --log.no-progress-bar --run.out-dir "/tmp/runs/$1" > "$OUT/train_$1.log" 2>&1
}
moe_run deepseek-v3-tiny &
moe_run moe-small &
timeout 150 python3 -m pytest -q tests/test_device.py -rs -p no:cacheprovider > "$OUT/pytest.log" 2>&1 &
wait
tail -n 4 "$OUT"/train_*.log "$OUT/pytest.log"
probe="python3 -m experiments.probes.moe_vs_dense --device cuda --dtype bf16 --hidden 1024 --experts 16 --expert-ffn 1024 --batch 16 --seq 1024"
timeout 100 $probe --rounds 12 --json "$OUT/moe_eager.json" > "$OUT/moe_vs_dense.log" 2>&1
timeout 200 $probe --rounds 12 --compile --variants 1.0 1.25 --json "$OUT/moe_compiled.json" >> "$OUT/moe_vs_dense.log" 2>&1
cat "$OUT/moe_vs_dense.log" | grep -v Warning
fi

if runs_phase 5; then
echo "phase 5 $(date +%T)"
timeout 360 python3 -m experiments.bench --device cuda --dtype bf16 --variants func-compiled module-compiled \
    --repeats 1 --steps 10 --layers 16 --heads 16 --hidden 2048 --seq 2048 --vocab 50304 --batch 8 \
    --json-out "$OUT/bench_1b_bf16.json" > "$OUT/bench_1b_bf16.log" 2>&1
tail -n 8 "$OUT/bench_1b_bf16.log"
fi

(cd /tmp && find runs -name log.jsonl 2>/dev/null | tar czf "$OUT/runs.tar.gz" -T -)
# BUNDLE_LOGS=1 moves the logs this run wrote into one logs.tar.gz (for a transfer that takes
# only a few files); other files in $OUT are left alone.
if [[ "${BUNDLE_LOGS:-0}" == 1 ]]; then
    (cd "$OUT" && find . -maxdepth 1 -name '*.log' -newer "$started_mark" -print0 \
        | tar czf logs.tar.gz --remove-files --null -T -)
fi
rm -f "$started_mark"
echo "done $(date +%T)"
