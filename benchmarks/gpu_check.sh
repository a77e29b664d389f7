#!/usr/bin/env bash
# The GPU checks in one call, for a machine with one NVIDIA GPU and no network:
#   1. tests/test_core_cuda.py (greedy equality on CUDA: eager, static, CUDA graphs; chains and trees),
#   2. `mmspec bench gpu` on the text workload at batch 1 (Llama-2-7B shapes, random bf16 weights,
#      forced acceptance) with the static and CUDA-graph rows,
#   3. with the time left, the LLaVA-1.5-7B-shaped workload at batch 1 and the text one at batch 4,
#   4. and a diagnostic for `auto`'s slow steps on the GPU: text at batch 1 with cuDNN's attention off.
# Usage (repository root): bash benchmarks/gpu_check.sh OUTDIR [SECONDS]
# SECONDS (default 540) bounds the whole script; each step gets what is left. Figures and logs go
# to OUTDIR. A `.whl/` folder of wheels (e.g. the transformers version mmspec is tested on) is
# installed first when present; mmspec itself is installed from this checkout without its
# dependencies (the machine's torch is used).
set -u
OUT=${1:?usage: gpu_check.sh OUTDIR [SECONDS]}
BUDGET=${2:-540}
END=$(( $(date +%s) + BUDGET ))
left() { echo $(( END - $(date +%s) )); }
bounded() { local s=$1; shift; if [ "$s" -gt 10 ]; then timeout "$s" "$@"; else echo "skipped (no time left): $*"; fi; }
mkdir -p "$OUT"
ROOT=$(pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mmspec_deps .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/mmspec_deps
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/mmspec_site . || exit 1
export PYTHONPATH=/tmp/mmspec_site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp  # so that the checkout's mmspec/ folder does not shadow the installed package
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, transformers, mmspec; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/versions.txt"

echo "== tests/test_core_cuda.py ($(left) s left)"
bounded $(( $(left) > 200 ? 150 : $(left) - 40 )) python3 -m pytest -q -p no:cacheprovider -rA "$ROOT/tests/test_core_cuda.py" 2>&1 | tee "$OUT/test_core_cuda.log"

echo "== bench gpu: text B=1 with the static and CUDA-graph rows ($(left) s left)"
bounded $(( $(left) - 20 )) python3 -m mmspec.cli bench gpu --workloads text:1 --compile --repeats 2 \
  --json "$OUT/bench_gpu_text1.json" 2>&1 | tee "$OUT/bench_gpu_text1.log"

echo "== bench gpu: the other workloads, as time allows ($(left) s left)"
bounded $(( $(left) - 10 )) python3 -m mmspec.cli bench gpu --workloads llava:1,text:4 --repeats 2 --deadline-s 20 \
  --json "$OUT/bench_gpu_more.json" 2>&1 | tee "$OUT/bench_gpu_more.log"
echo "== diagnostic: text B=1 without cuDNN attention (auto vs fixed K), as time allows ($(left) s left)"
bounded $(( $(left) - 10 )) python3 -m mmspec.cli bench gpu --workloads text:1 --repeats 2 --no-cudnn-attention \
  --json "$OUT/bench_gpu_no_cudnn.json" 2>&1 | tee "$OUT/bench_gpu_no_cudnn.log"
echo "== done ($(left) s left)"
