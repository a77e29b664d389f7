#!/usr/bin/env bash
# The GPU checks in one call, for a machine with one NVIDIA GPU and no network:
#   tests     tests/test_core_cuda.py (greedy equality on CUDA: eager, static, CUDA graphs; chains and
#             trees; the attention-backend choice; a CPU generator driving a rule on CUDA tensors),
#   vlm       `mmspec bench vlm --device cuda` on the bundled testbed VLM (captions and VQA, batch 1 and 4),
#   imagegen  `mmspec bench imagegen --device cuda` on the bundled testbed generator (batch 1 and 8;
#             speed only: the judge's quality figures are the CPU run's, same seeds; exact, invariant
#             and LANTERN Jacobi rows, fixed and auto windows, the small-model drafter),
#   mar       `mmspec bench mar --device cuda` on the bundled testbed MAR pair (batch 1 and 8; plain,
#             exact and relaxed CSpD and the fewer-steps rows; speed only): on the GPU a CSpD verify's
#             prefix sequences are extra rows of one forward, on the CPU each costs a plain step,
#   b4        `mmspec bench gpu` (Llama-2-7B shapes, random bf16 weights, forced acceptance, a fresh
#             prompt per call) on text at batch 4; the auto row carries its controller's estimates, a
#             row of auto held at K = 5 tells whether the adaptive path itself costs per step, and fixed
#             K = 1 and 3 rows whether auto's choice was right (session 44's auto drafted K = 1-4 there,
#             its estimates tying K = 1 with K = 5; the step took ~85 s before those two rows were added),
#   b1        text and LLaVA-shaped prompts at batch 1 with mmspec's and torch's attention choice,
#   and with SDPA_PROBE=1 the per-backend cost of attention on never-seen shapes.
# Usage (repository root): [STEPS=tests,vlm,...] bash benchmarks/gpu_check.sh OUTDIR [SECONDS]
# A device call may run 10 minutes and a session holds ~15 in all, machine starts included, so split
# them: session 38 (H100) ran STEPS=tests,mar,b4 in 305 s (tests 70 s, b4 85 s; mar at 2 rounds ran
# out of its 120 s during batch 8, so it runs one round now), then vlm, imagegen and mar at one round
# in 265 s on the still-warm machine. The benches write their JSON after each batch size (marked
# "partial" until they finish), so a step stopped at its bound keeps what it measured.
# SECONDS (default 540) bounds the whole script; each step gets what is left (vlm at most 160 s,
# imagegen 200 s, mar 150 s). Figures and logs go to OUTDIR (8 files: the device tool brings back 8;
# SDPA_PROBE=1 adds a ninth, so drop a step then).
# A `.whl/` folder of wheels is installed first when present: the machine has torch and
# transformers' own dependencies but not diffusers, einops or pillow (session 30), so carry
# transformers (the tested version), diffusers, importlib_metadata, zipp, einops, pillow and
# requests with its dependencies (`pip download --no-deps`, pillow for the machine's Python).
# mmspec itself is installed from this checkout without its dependencies.
set -u
OUT=${1:?usage: gpu_check.sh OUTDIR [SECONDS]}
BUDGET=${2:-540}
END=$(( $(date +%s) + BUDGET ))
left() { echo $(( END - $(date +%s) )); }
STEPS=",${STEPS:-tests,vlm,imagegen,mar,b4,b1},"  # which steps to run (comma-separated)
step() { case "$STEPS" in *",$1,"*) return 0;; *) return 1;; esac; }
bounded() { local s=$1; shift; if [ "$s" -gt 10 ]; then timeout "$s" "$@"; else echo "skipped (no time left): $*"; fi; }
mkdir -p "$OUT"
ROOT=$(pwd)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mmspec_deps .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/mmspec_deps
fi
rm -rf /tmp/mmspec_site  # a warm machine keeps the last call's install; pip would not replace it
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/mmspec_site . || exit 1
export PYTHONPATH=/tmp/mmspec_site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp  # so that the checkout's mmspec/ folder does not shadow the installed package
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, transformers, mmspec; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/env.txt"

if step tests; then
echo "== tests/test_core_cuda.py ($(left) s left)"
bounded $(( $(left) > 200 ? 150 : $(left) - 40 )) python3 -m pytest -q -s -p no:cacheprovider "$ROOT/tests/test_core_cuda.py" 2>&1 | tee "$OUT/test_core_cuda.log"
fi

if step vlm; then
echo "== bench vlm on the GPU: the testbed VLM's captions and answers at batch 1 and 4 ($(left) s left)"
bounded $(( $(left) > 200 ? 160 : $(left) - 40 )) python3 -m mmspec.cli bench vlm --model "$ROOT/assets/testbed/vlm" --device cuda --tasks caption,vqa --batch-sizes 1,4 --repeats 2 \
  --json "$OUT/bench_vlm_cuda.json" 2>&1 | grep -v DEBUG | tee -a "$OUT/bench.log"
fi

if step imagegen; then
echo "== bench imagegen on the GPU: the testbed generator at batch 1 and 8 ($(left) s left)"
bounded $(( $(left) > 240 ? 200 : $(left) - 40 )) python3 -m mmspec.cli bench imagegen --model "$ROOT/assets/testbed/imagegen" --device cuda --judge-images 0 --repeats 2 \
  --methods plain,invariant/plain,exact/jacobi-maximal,exact/jacobi-gumbel@8,exact/jacobi-gumbel@auto,invariant/jacobi-gumbel,invariant/jacobi-gumbel@8,invariant/jacobi-gumbel@auto,lantern/jacobi-maximal,exact/model,exact/model@auto \
  --json "$OUT/bench_imagegen_cuda.json" 2>&1 | grep -v DEBUG | tee -a "$OUT/bench.log"
fi

if step mar; then
echo "== bench mar on the GPU: the testbed MAR pair at batch 1 and 8 ($(left) s left)"
bounded $(( $(left) > 230 ? 150 : $(left) - 60 )) python3 -m mmspec.cli bench mar --model "$ROOT/assets/testbed/mar" --device cuda --no-judge --repeats 1 \
  --json "$OUT/bench_mar_cuda.json" 2>&1 | grep -v DEBUG | tee -a "$OUT/bench.log"
fi

if step b4; then
echo "== bench gpu: text at batch 4 (auto's choice there: the auto row carries its controller's state) ($(left) s left)"
bounded $(( $(left) - 20 )) python3 -m mmspec.cli bench gpu --workloads text:4 --repeats 2 --no-attention-rows --pinned-auto-row --other-fixed-k 1,3 \
  --json "$OUT/bench_gpu_b4.json" 2>&1 | grep -v DEBUG | tee -a "$OUT/bench.log"
fi

if step b1; then
echo "== bench gpu: text and llava at B=1, mmspec's and torch's attention choice, as time allows ($(left) s left)"
bounded $(( $(left) - 10 )) python3 -m mmspec.cli bench gpu --workloads text:1,llava:1 --repeats 2 --deadline-s 100 \
  --json "$OUT/bench_gpu_b1.json" 2>&1 | grep -v DEBUG | tee -a "$OUT/bench.log"
fi
if [ "${SDPA_PROBE:-0}" = 1 ]; then
echo "== attention on fresh shapes, per backend ($(left) s left)"
  bounded 60 python3 "$ROOT/benchmarks/sdpa_fresh_shapes.py" --json "$OUT/sdpa_fresh_shapes.json" 2>&1 | tee -a "$OUT/env.txt"
fi
echo "== done ($(left) s left)"
