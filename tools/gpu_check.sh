#!/usr/bin/env bash
# Everything a lent GPU is needed for, in one run (device time is scarce; each new machine takes minutes
# to start): the CUDA tests, the GPU benchmark, then the whole suite. Run from the repository root on the
# GPU machine, with the torch already there (no venv: it has no network):
#
#     bash tools/gpu_check.sh            # logs into $OUT (the device tool's folder) or ./gpu-check
#
# Each part has its own time limit (seconds; override by variable) and writes its log as it goes, so a
# part cut off still leaves what it printed. The whole suite runs without pytest-xdist: on an H100 machine
# 14 xdist workers took minutes to start and compile in parallel, and got through 80% in 330 s.
set -u
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD

python3 -c "import torch, mixprec.hardware as h; print(h.hardware_line())" 2>&1 | tee "$out/hardware.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$out/hardware.txt"

echo "== pytest -m cuda"
timeout "${CUDA_TESTS_S:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfEs tests \
    > "$out/cuda_tests.log" 2>&1
tail -n 3 "$out/cuda_tests.log"

echo "== train_step.py --device cuda (GPT, MLP; eager and compiled)"
timeout "${BENCH_S:-300}" python3 benchmarks/train_step.py --device cuda > "$out/train_step.log" 2>&1
grep -E "^hardware|GEMM 8192|failed" "$out/train_step.log"

echo "== the whole suite"
timeout "${SUITE_S:-400}" python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests \
    > "$out/suite.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.log" | tail -n 40
