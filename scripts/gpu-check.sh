#!/usr/bin/env bash
# The checks a session runs when it is lent a GPU, in one go (site-config/README.md, "Measuring on a real GPU"):
#   1. scripts/measure_gpu.py on the built-in workloads: torch's max_memory_allocated/reserved and
#      NVML's device peak beside the CPU estimate, plus the allocation diff (allocations the GPU
#      run made that the CPU trace lacks, with the Python line that made them);
#   2. scripts/measure_rnn_reserve.py: the reserve space cuDNN's RNN keeps for backward, over a grid of
#      LSTM/GRU/RNN shapes (the estimator flags RNNs because only cuDNN on a GPU sizes it);
#   3. `vest calibrate` for this GPU type (the site-config lines with the measured context).
# Results go to $OUT (the device tool's folder) or benchmarks/gpu/. Runs from a checkout without
# installing: PYTHONPATH points at it. Pure-Python dependencies missing on the machine (tabulate,
# toml, timm) can be carried as wheels in .whl/ (see the device tool's README); so can bitsandbytes'
# wheel (43 MB) for the 8-bit optimizer workload, which otherwise reports "failed" and the rest run.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/gpu}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" | tee -a "$out/device.txt"
python3 scripts/measure_gpu.py --out "$out/gpu-measurements.csv" --alloc-diff "$out/alloc-diff" "$@" 2>&1 | tee "$out/measure.log"
rc=$?
python3 scripts/measure_rnn_reserve.py --out "$out/rnn-reserve.csv" 2>&1 | tee "$out/rnn-reserve.log"
python3 -m vest_slurm.cli calibrate --gres-type "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')" 2>&1 | tee "$out/calibrate.txt"
exit $rc
