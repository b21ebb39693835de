#!/usr/bin/env bash
# One device-machine session: build, GPU test suite, benchmarks. Logs and JSON land in $OUT.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_run.sh [test|bench|all] [pytest args...]
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/spk_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MAX_JOBS=${MAX_JOBS:-16}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
start=$(date +%s)
if ! python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -c "
import torch, spkernels, spkernels._library as L
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl runtime', L.runtime_nccl_version(), 'compiled', L.COMPILED_NCCL_VERSION)
print('ops:', sorted(n for n in torch.ops.spkernels._dir if not n.startswith('_')) if hasattr(torch.ops.spkernels, '_dir') else '')
" 2>&1 | tee "$OUT/import.log"
rc=0
if [[ $what == test || $what == all ]]; then
  targets=("$@"); [[ ${#targets[@]} -eq 0 ]] && targets=(tests)
  timeout 1200 python3 -m pytest -q -p no:cacheprovider "${targets[@]}" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
  rc=${PIPESTATUS[0]}
  echo "pytest rc=$rc"
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-420} python3 bench/collectives.py ${BENCH_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
exit $rc
