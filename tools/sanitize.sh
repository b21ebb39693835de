#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over every spkernels CUDA kernel: the local ops
# in one process and the comm ops in two (tools/sanitize_ops.py), on the GPU machine after the
# package is built (tools/gpu_check.sh builds it).
#
# Usage: bash tools/sanitize.sh [tool ...]        (default: memcheck racecheck synccheck)
#   SAN_MODES="local comm"   which workloads (default both)
#   SAN_TIMEOUT=240          seconds per tool x workload run
#   SAN_ALL_KERNELS=1        also instrument NCCL's own kernels (default: skip ncclDevKernel_*, not ours)
#   SAN_API_ERRORS=explicit  also count failed CUDA API calls (default no: NCCL's init probes kernel
#                            images with cudaFuncGetAttributes, and every probe that finds none for
#                            this GPU is reported as an error; device memory errors are always counted)
# Writes $OUT/sanitize.log (every run's output, --print-limit 20 reports each) and
# $OUT/sanitize_summary.txt, one line per run:
#   memcheck local: ERROR SUMMARY: 0 errors (processes 1, rc 0, 25 s, driver done)
# The errors are summed over every process of the run (--target-processes all). "driver done" says
# the workload reached its end: a run that crashed or timed out is never reported as clean.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spk_out}; mkdir -p "$OUT"
tools=("$@"); [[ ${#tools[@]} -eq 0 ]] && tools=(memcheck racecheck synccheck)
modes=(${SAN_MODES:-local comm})
timeout_s=${SAN_TIMEOUT:-240}
log="$OUT/sanitize.log"; summary="$OUT/sanitize_summary.txt"
: > "$log"; : > "$summary"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Every tensor its own cudaMalloc, so memcheck sees the true bounds of each (the caching allocator's
# pooled blocks would hide an overrun into a neighbour).
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [[ -z $san ]]; then echo "compute-sanitizer not found" | tee -a "$summary"; exit 1; fi
if ! python3 -c "import spkernels._library as L; assert L.HAS_CUDA_KERNELS" 2>>"$log"; then
  echo "spkernels with CUDA kernels is not importable: build it first (tools/gpu_check.sh)" | tee -a "$summary"
  exit 1
fi
filter=()
if [[ ${SAN_ALL_KERNELS:-0} != 1 ]] && "$san" --help 2>&1 | grep -q -- "--kernel-name-exclude"; then
  filter=(--kernel-name-exclude kns=ncclDevKernel)
fi
echo "$("$san" --version 2>&1 | tail -1); filter: ${filter[*]:-none}" | tee -a "$summary"

status=0
for tool in "${tools[@]}"; do
  for mode in "${modes[@]}"; do
    echo "===== $tool $mode" >> "$log"
    start=$(date +%s)
    timeout -k 15 "$timeout_s" "$san" --tool "$tool" --print-limit 20 --target-processes all "${filter[@]}" \
      --report-api-errors "${SAN_API_ERRORS:-no}" \
      python3 tools/sanitize_ops.py --mode "$mode" > "$OUT/.san_run.log" 2>&1
    rc=$?
    cat "$OUT/.san_run.log" >> "$log"
    secs=$(( $(date +%s) - start ))
    # One summary per process the sanitizer followed: "ERROR SUMMARY: N errors", or for racecheck
    # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"; every hazard counts.
    procs=$(grep -cE "(ERROR|RACECHECK) SUMMARY:" "$OUT/.san_run.log")
    errors=$(grep -oE "(ERROR|RACECHECK) SUMMARY: [0-9]+" "$OUT/.san_run.log" | awk '{s += $3} END {print s + 0}')
    done_=$(grep -q "SANITIZE_OPS DONE" "$OUT/.san_run.log" && echo "driver done" || echo "DRIVER DID NOT FINISH")
    [[ $rc -eq 124 || $rc -eq 137 ]] && done_="TIMED OUT after ${timeout_s} s"
    line="$tool $mode: ERROR SUMMARY: $errors errors (processes $procs, rc $rc, $secs s, $done_)"
    echo "$line" | tee -a "$summary"
    if [[ $errors -ne 0 || $procs -eq 0 || $done_ != "driver done" ]]; then status=1; fi
    rm -f "$OUT/.san_run.log"
  done
done
echo "sanitize: $([[ $status -eq 0 ]] && echo CLEAN || echo "NOT CLEAN (see $log)")" | tee -a "$summary"
exit $status
