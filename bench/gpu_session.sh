#!/usr/bin/env bash
# Every GPU check of a session in one run, about 9 minutes on an H200, for a machine that has torch
# with CUDA but not hivemind: its dependencies come as py3.12 wheels in .wheels/ (an ignored folder,
# carried to the machine). Writes its logs and JSON under $OUT (default /tmp/gpu-out).
#
#     bash bench/gpu_session.sh            # the CUDA tests, then a 125m swarm: 2 full peers + a 2-stage chain
#     SWARM_MINUTES=3 bash bench/gpu_session.sh
#
# 1. tests/system/test_cuda_path.py and test_cuda_swarm.py: CPU and CUDA members end each round on one
#    θ, chains with CUDA stages included (skipped where CUDA is absent);
# 2. bench/gpu_swarm.py at 125m, H = 100, batch 8: each peer's utilization (the GPU-box issue asks
#    >= 95 %), tokens/s, the H its rounds advise, and each stage's peak GPU memory against its estimate.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .wheels/*.whl > /dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --root-user-action=ignore .wheels/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 240 python -m pytest -q -p no:cacheprovider -rs tests/system/test_cuda_path.py tests/system/test_cuda_swarm.py \
    2>&1 | tee "$OUT/cuda_tests.log"
timeout $(( ${SWARM_MINUTES:-4} * 60 + 150 )) python bench/gpu_swarm.py --preset 125m --inner-steps 100 --batch 8 \
    --full 2 --chain-stages 2 --stage-memory-gb 8.5 --minutes "${SWARM_MINUTES:-4}" --workdir /tmp/gpu-swarm \
    --json "$OUT/gpu_swarm_125m.json" 2>&1 | tee "$OUT/gpu_swarm_125m.log"
cp /tmp/gpu-swarm/*.log "$OUT/" 2> /dev/null  # the peers' and coordinator's logs, not their checkpoints
