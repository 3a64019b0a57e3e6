#!/usr/bin/env bash
# GPU check (issues 15, 31), run as is on a CUDA machine whose python3 has torch, transformers, peft, accelerate,
# tokenizers, safetensors, pyyaml and pytest: rlhflab comes from src/ (nothing installed), nothing is downloaded,
# and test files needing a missing package (datasets, vllm, ...) are skipped with the reason. At most ~5 min:
#   1. tests/cuda (150 s): lean vs HF in bf16, exact first step with LoRA, reproducible sampling, vLLM when installed;
#   2. benchmarks/gpu_check.py (what is left of 300 s, at least 120): SFT, DPO, GRPO and PPO on a random
#      Qwen2.5-0.5B-shaped model: LoRA and full fine-tuning, float32 / bf16 / fp16, checkpointing on and off (rows
#      that no longer fit are listed as not run).
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--dry] [gpu_check.py arguments, e.g. --backends lean,hf]
#
# --out DIR (default gpu_check_out/): log.txt (everything printed, as it is printed), tests.txt, results.json,
# table.md and each child process's log, written as the run goes, so a run killed part way still leaves what it
# measured.
# --dry: no GPU needed: the same import path and test collection, then gpu_check.py --smoke on the CPU (CI runs
# this in an interpreter without datasets: tests/test_gpu_check.py).
# PYTHON=... picks the interpreter (default python3). Exit status: non-zero if a part failed.
set -uo pipefail
OUT=gpu_check_out
DRY=0
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        --dry) DRY=1; shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # a relative --out is the caller's, not the repository's
cd "$(dirname "$0")/.."
rm -f "$OUT/log.txt" "$OUT/tests.txt" "$OUT/results.json" "$OUT/table.md" "$OUT"/child-*.log  # no earlier run's figures left to mislead
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/log.txt") 2>&1
tee_pid=$!
trap 'exec >&- 2>&-; wait "$tee_pid"' EXIT  # bash does not wait for tee: the log's last lines would be lost

"$PY" - <<'PY' || exit 3
import importlib.util, sys, torch, transformers, peft, accelerate, rlhflab
missing = [m for m in ("datasets", "vllm", "deepspeed", "trl") if importlib.util.find_spec(m) is None]
print(f"## python {sys.version.split()[0]} | torch {torch.__version__} (CUDA {torch.version.cuda}) | transformers "
      f"{transformers.__version__} | peft {peft.__version__} | accelerate {accelerate.__version__}")
print(f"## rlhflab from {rlhflab.__file__}; not installed here: {', '.join(missing) or 'none'}")
if torch.cuda.is_available():
    print(f"## GPU: {torch.cuda.get_device_name(0)}")
PY
if [ "$DRY" -eq 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: torch sees no CUDA GPU here; on a CPU run: bash benchmarks/gpu_check.sh --dry" >&2
    exit 2
fi

echo "## 1. tests/cuda"
# only the CUDA test files are collected (tests/conftest.py skips them without a GPU, naming why)
timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/cuda 2>&1 | tee "$OUT/tests.txt"
tests_status=${PIPESTATUS[0]}

echo "## 2. SFT / DPO / GRPO / PPO benchmark"
budget=$((300 - SECONDS))  # what the tests left of ~5 minutes, at least 120 s; rows that no longer fit are not run
[ "$budget" -lt 120 ] && budget=120
SMOKE=()
[ "$DRY" -eq 1 ] && SMOKE=(--smoke)
timeout $((budget + 20)) "$PY" benchmarks/gpu_check.py ${SMOKE[@]+"${SMOKE[@]}"} --budget_s "$budget" --out "$OUT" \
    ${PASS[@]+"${PASS[@]}"}
bench_status=$?

echo "## gpu_check.sh: tests exit ${tests_status}, benchmark exit ${bench_status}; results in ${OUT}/"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
