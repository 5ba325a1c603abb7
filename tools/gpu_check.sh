#!/usr/bin/env bash
# Everything a lent GPU is needed for, in one run, sized for a session's 15 minutes of device time, of
# which starting a machine takes 1-2: the CUDA tests, the GPT benchmark at a batch that keeps the GPU
# busier, each phase of the compiled step and the host's waits in it, the FSDP2 recipe on the GPU. The
# default limits add up to 530 s, inside one call's 600; the options below add to that, so give them a
# call of their own. Run from the repository root on the GPU machine, with the torch already there (no
# venv: it has no network):
#
#     bash tools/gpu_check.sh               # logs into $OUT (the device tool's folder) or ./gpu-check
#     BATCHES="128 16" bash tools/gpu_check.sh   # the batch too (+170 s)
#     DIST_S=90 bash tools/gpu_check.sh     # and the distributed tests
#     LARGE_S=200 bash tools/gpu_check.sh   # and an 84M-parameter GPT the GPU's arithmetic limits
#     SUITE_S=400 bash tools/gpu_check.sh   # and then the whole suite (over 6 minutes on an H100 machine)
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
timeout "${CUDA_TESTS_S:-120}" python3 -m pytest -q -m cuda -p no:cacheprovider -rfEs tests \
    > "$out/cuda_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/cuda_tests.log" | tail -n 20

# The bf16 configurations torch.autocast is measured against; eager and compiled.
configs=(--config "torch.autocast bf16" --config "mixprec O1 bf16" --config "mixprec O2 bf16, 16 B/param"
         --config "mixprec Learner.to_bf16()" --config "mixprec O2 bf16, split masters (14 B/param)")
for batch in ${BATCHES:-128}; do
    echo "== train_step.py --device cuda --workload gpt --batch $batch"
    timeout "${BENCH_S:-200}" python3 benchmarks/train_step.py --device cuda --workload gpt --batch "$batch" \
        --steps "${STEPS:-20}" "${configs[@]}" > "$out/gpt_b$batch.log" 2>&1
    grep -E "^hardware|GEMM 8192|configuration|│ (torch|mixprec)|failed" "$out/gpt_b$batch.log"
done

# The open lead (RESULTS.md, H200 section): O2's extra time grows with the batch. Each phase between
# synchronisations at batch 128, and where one step makes the host wait for the GPU.
echo "== train_step.py --phases --sync-check (compiled, batch 128)"
timeout "${PHASES_S:-150}" python3 benchmarks/train_step.py --device cuda --workload gpt --batch 128 \
    --steps "${STEPS:-20}" --compiled-only --sync-check --phases "torch.autocast bf16" \
    --phases "mixprec O2 bf16" --phases "mixprec O2 bf16, 16 B/param" > "$out/phases.log" 2>&1
grep -E "configuration|│ (torch|mixprec)|host waits|^  [a-z_]+\.py:|failed" "$out/phases.log"

echo "== examples/fsdp2_train.py with one rank: on the GPU, with NCCL (two ranks here train on the CPU)"
timeout "${FSDP_S:-60}" python3 examples/fsdp2_train.py --world-size 1 > "$out/fsdp2_gpu.log" 2>&1
echo "exit status $? (0: the rank skipped the overflow as the fp32 run did and stayed within 1e-2 of it)"
tail -n 3 "$out/fsdp2_gpu.log"

if [ "${LARGE_S:-0}" -gt 0 ]; then
    # The GPT above leaves the GPU waiting on the host at 20-30% MFU; at this size its arithmetic decides.
    echo "== train_step.py --device cuda --workload gpt-large (84M parameters, 16k tokens a step)"
    timeout "$LARGE_S" python3 benchmarks/train_step.py --device cuda --workload gpt-large \
        --steps "${LARGE_STEPS:-10}" --config "torch.autocast bf16" --config "mixprec O2 bf16" \
        --config "mixprec Learner.to_bf16()" --config "mixprec O2 bf16, split masters (14 B/param)" \
        > "$out/gpt_large.log" 2>&1
    grep -E "^hardware|GEMM 8192|configuration|│ (torch|mixprec)|failed" "$out/gpt_large.log"
fi

if [ "${DIST_S:-0}" -gt 0 ]; then
    echo "== the distributed tests (a 1-GPU machine trains extra ranks on the CPU; 50 s on an H200 machine)"
    timeout "$DIST_S" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_distributed.py \
        > "$out/distributed.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/distributed.log" | tail -n 10
fi

if [ "${SUITE_S:-0}" -gt 0 ]; then
    echo "== the whole suite"
    timeout "$SUITE_S" python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests \
        > "$out/suite.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.log" | tail -n 40
fi
