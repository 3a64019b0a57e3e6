#!/usr/bin/env bash
# GPU readiness check (issue 15), run as is on a machine with a CUDA GPU and the project installed
# (make setup, or pip install -e ".[test]"; add ".[vllm]" for the vLLM rows). No downloads. At most 9.5 min (tests 4, benchmark 5.5):
#   1. the test suite's CUDA-marked tests (pytest -m cuda: lean vs HF in bf16, exact first step with LoRA,
#      reproducible sampling, and the vLLM backend when vLLM is installed);
#   2. benchmarks/gpu_check.py: PPO and GRPO with LoRA on a random Qwen2.5-0.5B-shaped model in bf16, per
#      generation backend (lean, and vllm when installed): a markdown table on stdout.
# Extra arguments go to gpu_check.py (e.g. --backends lean,hf,vllm). Exit status: non-zero if either part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: torch sees no CUDA GPU here; on CPU run: $PY benchmarks/gpu_check.py --smoke" >&2
    exit 2
fi
"$PY" -c "import torch; print('##', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"

echo "## 1. CUDA-marked tests"
timeout 240 "$PY" -m pytest -q -m cuda -rs -p no:cacheprovider tests
tests_status=$?

echo "## 2. PPO / GRPO benchmark"
timeout 330 "$PY" benchmarks/gpu_check.py --budget_s 300 "$@"
bench_status=$?

echo "## gpu_check.sh: tests exit ${tests_status}, benchmark exit ${bench_status}"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
