#!/usr/bin/env bash
# Every GPU check of a session in one run, about 9 minutes on an H200, for a machine that has torch
# with CUDA but not hivemind: its dependencies come as py3.12 wheels in .wheels/ (an ignored folder that
# bench/gpu_wheels.sh fills, carried to the machine). Writes its logs and JSON under $OUT
# (default /tmp/gpu-out): at most 8 files, the peers' logs as one archive.
#
#     bash bench/gpu_session.sh            # the CUDA tests, then two 125m swarms
#     TESTS_S=150 FULL_MINUTES=2 SWARM_MINUTES=2 bash bench/gpu_session.sh
#
# 1. tests/system/test_cuda_path.py and test_cuda_swarm.py: CPU and CUDA members end each round on one
#    θ, chains with CUDA stages included (skipped where CUDA is absent), 4 at a time (pytest-xdist);
#    then bench/encode_overlap.py at 125m (about a minute, into gpu.txt): does the exchange's encode
#    wait behind the inner steps' kernels on the default stream, and would a stream of its own help;
# 2. bench/gpu_swarm.py at 125m, H = 100, batch 8, two full peers alone on the card (the GPU-box
#    issue's shape for its >= 95 % utilization), for FULL_MINUTES (0: skipped). Where py-spy is
#    installed (its wheel in .wheels/), the first full peer's threads are sampled for 60 s of its
#    steady rounds (raw folded stacks, pyspy_full0.txt): where a GPU peer's exchange spends its CPU;
# 3. the same with a 2-stage chain beside the two full peers, for SWARM_MINUTES (0: skipped): the
#    chain's tokens/s, its early close and each stage's peak GPU memory against its estimate.
# Each swarm prints where a round's seconds go and keeps each peer's "round N timing:" debug lines.
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
# the encode beside the inner steps, on the default stream and on one of its own (bench/encode_overlap.py)
timeout 150 $PY bench/encode_overlap.py --device cuda --shape 125m 2>&1 | tee -a "$OUT/gpu.txt"
swarm() {  # swarm NAME MINUTES CHAIN_STAGES
    [ "$2" -gt 0 ] || return 0
    timeout $(( $2 * 60 + 150 )) $PY bench/gpu_swarm.py --preset 125m --inner-steps 100 --batch 8 --full 2 \
        --chain-stages "$3" --stage-memory-gb 8.5 --minutes "$2" --log-level debug --workdir "/tmp/gpu-$1" \
        --json "$OUT/gpu_$1.json" 2>&1 | tee "$OUT/gpu_$1.log"
}
SPY=$(command -v py-spy || ls /tmp/site/bin/py-spy 2> /dev/null)
if [ -n "$SPY" ] && [ "${FULL_MINUTES:-2}" -gt 1 ]; then
    (  # the first full peer, once its start and first exchanges are behind it
        sleep 100
        pid=$(pgrep -f "voloco peer.*gpu-full/peer0" | head -1)
        [ -n "$pid" ] && "$SPY" record --pid "$pid" --duration 60 --rate 20 --threads --nonblocking --format raw \
            --output "$OUT/pyspy_full0.txt" > "$OUT/pyspy.log" 2>&1
    ) &
fi
swarm full "${FULL_MINUTES:-2}" 0
wait
swarm chain "${SWARM_MINUTES:-2}" 2
# the peers' and coordinator's logs and status files, not their checkpoints
(cd /tmp && tar czf "$OUT/gpu_swarm_logs.tgz" gpu-full/*.log gpu-full/peer*/status.json gpu-chain/*.log \
    gpu-chain/peer*/status.json 2> /dev/null)
