#!/usr/bin/env bash
# The one device check (a lent CUDA machine, ~8 min): CUDA tests, converted models on CUDA, the Hopper GEMM table,
# then the whole suite on that machine's torch. Logs and JSON go to $OUT (or ./gpu_out). Run from the repo root.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LOWBIT_CACHE_DIR=/tmp/lowbit-cache
PY=${PY:-python3}
{ date -u; nvidia-smi -L; $PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, sys.version.split()[0])"
  command -v cc gcc; nproc; grep -o -m1 'avx512_vnni\|avx2' /proc/cpuinfo | head -1; } 2>&1 | tee "$OUT/env.log"
echo "== CUDA tests"; timeout 90 $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs -k "cuda or gpu" \
  tests/test_kernels.py tests/test_kernels_paths.py tests/test_nn_quantized_linear_conv.py tests/test_numerics_qtensor.py \
  tests/test_export_onnx.py 2>&1 | tee "$OUT/cuda_tests.log"
timeout 90 $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_cuda_fused.py 2>&1 | tee -a "$OUT/cuda_tests.log"
echo "== models on CUDA"; timeout 120 $PY benchmarks/gpu_models.py --out-dir "$OUT" 2>&1 | grep -v "it/s\]" | tee "$OUT/models.log"
echo "== GEMM table"; timeout 180 $PY benchmarks/gpu.py --rounds 3 --reps 10 --out-dir "$OUT" 2>&1 | tee "$OUT/gemm.log"
echo "== whole suite on this machine's torch (-n 16, ${SUITE_S:-90} s cap)"
timeout "${SUITE_S:-90}" $PY -m pytest -q -p no:cacheprovider -n 16 -rf -o addopts="--import-mode=importlib" tests \
  > "$OUT/suite.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | cut -c1-220 | tail -40
