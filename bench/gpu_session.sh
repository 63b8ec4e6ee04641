#!/usr/bin/env bash
# Every GPU check of a session in one run, about 7 minutes on an H200, for a machine that has torch
# with CUDA but not hivemind: its dependencies come as py3.12 wheels in .wheels/ (an ignored folder,
# carried to the machine; docs/operations.md says which). Writes its logs and JSON under $OUT
# (default /tmp/gpu-out): at most 8 files, the peers' logs as one archive.
#
#     bash bench/gpu_session.sh            # the CUDA tests, then a 125m swarm: 2 full peers + a 2-stage chain
#     SWARM_MINUTES=3 bash bench/gpu_session.sh
#
# 1. tests/system/test_cuda_path.py and test_cuda_swarm.py: CPU and CUDA members end each round on one
#    θ, chains with CUDA stages included (skipped where CUDA is absent), 4 at a time (pytest-xdist);
# 2. bench/gpu_swarm.py at 125m, H = 100, batch 8: each peer's utilization (the GPU-box issue asks
#    >= 95 %), where a round's seconds go (and each peer's "round N timing:" debug lines in the logs),
#    tokens/s, the H its rounds advise, and each stage's peak GPU memory against its estimate.
set -u
OUT=${OUT:-/tmp/gpu-out}
PY=${PY:-python3}  # the machine's python3 is the one that holds torch
mkdir -p "$OUT"
if ls .wheels/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl \
        || { echo "installing .wheels failed"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, hivemind, peer.host.cli; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'hivemind', hivemind.__version__)" \
    2>&1 | tee -a "$OUT/gpu.txt" || exit 1
XDIST=$($PY -c "import xdist" 2> /dev/null && echo "-n 4")
timeout "${TESTS_S:-200}" $PY -m pytest -q -p no:cacheprovider -rs $XDIST tests/system/test_cuda_path.py \
    tests/system/test_cuda_swarm.py 2>&1 | tee "$OUT/cuda_tests.log"
timeout $(( ${SWARM_MINUTES:-3} * 60 + 150 )) $PY bench/gpu_swarm.py --preset 125m --inner-steps 100 --batch 8 \
    --full 2 --chain-stages 2 --stage-memory-gb 8.5 --minutes "${SWARM_MINUTES:-3}" --log-level debug --workdir /tmp/gpu-swarm \
    --json "$OUT/gpu_swarm_125m.json" 2>&1 | tee "$OUT/gpu_swarm_125m.log"
# the peers' and coordinator's logs and status files, not their checkpoints
(cd /tmp/gpu-swarm 2> /dev/null && tar czf "$OUT/gpu_swarm_logs.tgz" ./*.log ./peer*/status.json)
