#!/usr/bin/env bash
# One device-machine session: build, GPU test suite, benchmarks. Logs and JSON land in $OUT.
# Usage (on the GPU machine, from the repo root):
#   bash scripts/gpu_run.sh [all | comma list of test,runner,pp,bench,ab,envab,load,sanitize,wheel,profile,sass,probe] [pytest args...]
# Parts run in the order test, bench, ab, envab, runner, load, sanitize, wheel, profile, sass, probe,
# pp ("all": every part but ab, envab, profile, sass and probe). DEADLINE=<seconds> skips a part
# once less than its budget is left.
# ab: the same bench (AB_ARGS, default BENCH_ARGS) on this tree and on each tree under .ab/ (made
# by scripts/ab_trees.sh, carried along), built in place while this tree builds; ab_<name>.json
# each, compared by scripts/ab_table.py. AB_TESTS="<pytest args>": first run those tests on each
# .ab tree (its own build and tests) and print their summary line, to place a failure in a stack.
# envab: the same bench (AB_ARGS) on this tree's one build under each environment of AB_ENVS
# ("A=1 B=2;A=0": ';' between settings, the first is the base), ab_env<n>.json each, compared by
# scripts/ab_table.py: a temporary knob's settings in one call (session 13's chunk and waves sweeps).
# PROFILE_KERNELS="T:kernel ..." picks the targets of profile's ncu --set full (none: no such report);
# PROFILE_D: the hidden size of those ncu targets (default 4096); PROFILE_OPS: the op they run in
# (profile_tile.py --ops: pre, post_pre or head; default pre);
# PROFILE_T="T,..." the sizes of its per-kernel durations (PROFILE_DURATIONS=0 skips them);
# PROFILE_CACHE=none keeps the caches warm between those kernels (ncu flushes them by default);
# PROFILE_SP=0 skips its fused-boundary timeline.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/spk_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MAX_JOBS=${MAX_JOBS:-16}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
# At most 8 files come back from $OUT: machine.txt (with the tests' summary lines), pytest_gpu.log,
# the bench's json/png/txt, runner.log (runner, load console, wheel check, pp), load.json,
# sanitize_summary.txt (build.log on failure); ncu_profile.txt and ncu_csv.tgz (profile), sass.txt
# (sass) and probe.txt (probe) in place of some of them.
start=$(date +%s)
want() {  # what: all (but the on-demand parts), or a comma list
  [[ ($what == all && $1 != profile && $1 != ab && $1 != envab && $1 != sass && $1 != probe) || ,$what, == *,$1,* ]]
}
ab_trees=()
if want ab; then  # build the other trees in place, beside this tree's build
  for d in .ab/*/; do
    [[ -f $d/COMMIT ]] || continue
    ab_trees+=("${d%/}")
    (cd "$d" && MAX_JOBS=8 python3 setup.py build_ext --inplace > build.log 2>&1; echo $? > build.rc) &
  done
fi
# SPK_BENCH_PROBES=1: with the bench-only link probe (bench/sweep.py's link floors, test_link_probe).
if ! SPK_BENCH_PROBES=${SPK_BENCH_PROBES:-1} python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
rm -f "$OUT/build.log"
echo "build: $(( $(date +%s) - start )) s"
left() { echo $(( ${DEADLINE:-100000} - ($(date +%s) - start) )); }
fits() { if (( $(left) < $1 )); then echo "SKIPPED $2: $(left) s left < $1 s" | tee -a "$OUT/runner.log"; return 1; fi; }
python3 -c "
import torch, spkernels, spkernels._library as L
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl runtime', L.runtime_nccl_version(), 'compiled', L.COMPILED_NCCL_VERSION)
print('ops:', sorted(n.split('::')[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith('spkernels::')))
" 2>&1 | tee -a "$OUT/machine.txt"
rc=0
if want test && fits 120 test; then
  targets=("$@"); [[ ${#targets[@]} -eq 0 ]] && targets=(-m gpu tests)  # the GPU suite; CI runs the rest
  # A broken barrier shows as a timeout error, not a suite-long hang.
  SPK_BARRIER_TIMEOUT=${SPK_BARRIER_TIMEOUT:-30} timeout $(( $(left) < 1200 ? $(left) : 1200 )) python3 -m pytest -q -rP --durations=15 -p no:cacheprovider "${targets[@]}" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
  rc=${PIPESTATUS[0]}
  echo "pytest rc=$rc"
  # machine.txt always comes back: the suite's summary line goes there too
  echo "gpu suite (rc=$rc): $(tail -1 "$OUT/pytest_gpu.log")" >> "$OUT/machine.txt"
  grep -A2 "hang detection" "$OUT/pytest_gpu.log" | head -12
fi
if want bench && fits 90 bench; then
  eval "bench_args=(${BENCH_ARGS:---quick})"  # shell words: quotes as typed (--ref-D '')
  timeout $(( $(left) < ${BENCH_TIMEOUT:-420} ? $(left) : ${BENCH_TIMEOUT:-420} )) python3 bench/collectives.py "${bench_args[@]}" --out "$OUT" 2>&1 | tail -60
fi
eval "ab_args=(${AB_ARGS:-${BENCH_ARGS:---quick}})"  # shell words: quotes as typed (--compile-D '')
ab_bench() {  # tree name commit [VAR=value ...]: that tree's bench on its build (checked), with those
  local ok=0  # environment variables -> ab_<name>.json
  (cd "$1" && export PYTHONPATH=$PWD/python &&
    python3 -c "import spkernels, sys; sys.exit(not spkernels.__file__.startswith('$PWD/'))" &&
    env "${@:4}" timeout $(( $(left) < 300 ? $(left) : 300 )) python3 bench/collectives.py "${ab_args[@]}" --out "$OUT" \
      --name "ab_$2" --commit "$3") > "$OUT/ab_$2.log" 2>&1 || { ok=1; echo "ab $2: FAILED: $(tail -5 "$OUT/ab_$2.log")"; }
  rm -f "$OUT/ab_$2.png" "$OUT/ab_$2.txt" "$OUT/ab_$2.log"
  return $ok
}
if want ab && fits 60 ab; then
  wait  # the trees' builds
  eval "ab_tests=(${AB_TESTS:-})"
  results=()
  ab_bench "$PWD" this "${SPK_COMMIT:-this}" && results+=("$OUT/ab_this.json")
  for d in "${ab_trees[@]}"; do
    name=$(basename "$d")
    if [[ $(cat "$d/build.rc") != 0 ]]; then echo "ab $name: BUILD FAILED"; tail -20 "$d/build.log"; continue; fi
    if (( ${#ab_tests[@]} )) && fits 60 "ab $name tests"; then
      # One -q (AB_TESTS with its own -q made -qq, which prints no summary line).
      q=(-q); [[ " ${ab_tests[*]} " == *" -q "* ]] && q=()
      (cd "$d" && PYTHONPATH=$PWD/python SPK_BARRIER_TIMEOUT=30 timeout 240 python3 -m pytest "${q[@]}" -p no:cacheprovider \
        "${ab_tests[@]}" 2>&1 | tail -1 | sed "s|^|ab $name tests: |" | tee -a "$OUT/machine.txt")
    fi
    fits 30 "ab $name" && ab_bench "$PWD/$d" "$name" "$(cat "$d/COMMIT")" && results+=("$OUT/ab_$name.json")
  done
  (( ${#results[@]} )) && python3 scripts/ab_table.py "${results[@]}" | tee "$OUT/ab_table.txt"
fi
if want envab && fits 60 envab; then
  results=()
  IFS=';' read -ra settings <<< "${AB_ENVS:?envab needs AB_ENVS}"
  for n in "${!settings[@]}"; do
    fits 30 "envab ${settings[$n]}" || break
    echo "ab_env$n: ${settings[$n]}" | tee -a "$OUT/machine.txt"
    # shellcheck disable=SC2086  # the setting's words are the assignments
    ab_bench "$PWD" "env$n" "${SPK_COMMIT:-this}" ${settings[$n]} && results+=("$OUT/ab_env$n.json")
  done
  (( ${#results[@]} )) && python3 scripts/ab_table.py "${results[@]}" | tee "$OUT/ab_table.txt"
fi
if want runner && fits 100 runner; then
  # Issue 6 measurements: prefill with and without SP at 2 x 8k tokens; decode with and without graphs.
  run() { echo "=== $*" >> "$OUT/runner.log"; timeout ${RUNNER_TIMEOUT:-90} python3 -m spkernels.runner --device cuda --tp 2 \
            --preset v4-flash-like --quiet "$@" >> "$OUT/runner.log" 2>&1; echo "rc=$?" >> "$OUT/runner.log"; }
  run --prompt-lens 8192,8192 --gen 2 --warmup 1 --repeat 5 --sp-threshold 1024
  run --prompt-lens 8192,8192 --gen 2 --warmup 1 --repeat 5 --sp-threshold none
  run --prompts 16 --prompt-len 64 --gen 24 --warmup 1 --repeat 5
  run --prompts 16 --prompt-len 64 --gen 24 --warmup 1 --repeat 5 --no-graphs
  # Where the prefill's time goes (profiled runs are slower: shares only).
  run --prompt-lens 8192,8192 --gen 1 --warmup 1 --sp-threshold 1024 --profile
  run --prompt-lens 8192,8192 --gen 1 --warmup 1 --sp-threshold none --profile
  grep -E "^===|prefill|decode:|peak|profile|rc=|Error" "$OUT/runner.log"
fi
if want load && fits 90 load; then
  # Issue 8: back-to-back fused boundaries across the GPUs, checked as they run (bench/load.py).
  python3 bench/load.py --calls ${LOAD_CALLS:-100000} --timeout $(( $(left) - 30 )) --out "$OUT" 2>&1 \
    | tee -a "$OUT/runner.log" | grep -E "LOAD|Error|error" | tail -5
fi
if want sanitize && fits 90 sanitize; then
  SAN_TIMEOUT=${SAN_TIMEOUT:-120} bash scripts/sanitize.sh ${SAN_TOOLS:-memcheck} | tail -8
  grep -q "^sanitize: CLEAN" "$OUT/sanitize_summary.txt" || tail -80 "$OUT/sanitize.log" >> "$OUT/sanitize_summary.txt"
  rm -f "$OUT/sanitize.log"
fi
if want wheel && fits 150 wheel; then
  # Issue 8: the wheel installs into a fresh venv here and runs its smoke test (CPU and CUDA op).
  { echo "=== check_wheel"; timeout $(( $(left) - 10 )) bash scripts/check_wheel.sh 2>&1 | tail -15; } | tee -a "$OUT/runner.log"
fi
if want profile && fits 90 profile; then
  # ncu (clocks left alone) on the pre's two kernels where they fall short: pass 1 at T = 8192 and
  # pass 2 at decode (T = 8); details incl. warp stalls and the top stall lines, then every
  # spkernels kernel's duration at T = PROFILE_T (default 8, 64, 8192; caches flushed between kernels
  # unless PROFILE_CACHE=none).
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for spec in ${PROFILE_KERNELS:-8192:mhc_rows_kernel 8:mhc_collapse_row_kernel}; do
    [[ $spec == none ]] && continue
    T=${spec%%:*}; kernel=${spec#*:}
    echo "===== ncu --set full: $kernel at T = $T" >> "$OUT/ncu_profile.txt"
    rep=/tmp/ncu_${kernel}_$T
    # breakdown: the L2's and L1's throughput split by sub-unit (tags, sectors, crossbar), into the
    # raw page; without it if this ncu does not take it
    for extra in --metrics=breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,breakdown:l1tex__throughput.avg.pct_of_peak_sustained_active ""; do
      rm -f "$rep.ncu-rep"
      timeout 150 "$ncu" --clock-control none --set full --import-source yes -k "regex:$kernel" --launch-skip 1 \
        ${extra:+"$extra"} --launch-count 1 -f -o "$rep" python3 scripts/profile_tile.py --T "$T" --D "${PROFILE_D:-4096}" --ops "${PROFILE_OPS:-pre}" \
        >> "$OUT/ncu_profile.txt" 2>&1
      [[ -f $rep.ncu-rep ]] && break
    done
    "$ncu" -i "$rep.ncu-rep" --page details >> "$OUT/ncu_profile.txt" 2>&1
    # Where its warps wait: stall reasons and the hottest SASS lines (both CSVs come back in ncu_csv.tgz).
    "$ncu" -i "$rep.ncu-rep" --page raw --csv > "$rep.raw.csv" 2>&1
    "$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
    python3 scripts/ncu_summary.py "$rep.raw.csv" "$rep.sass.csv" >> "$OUT/ncu_profile.txt" 2>&1
  done
  csvs=$(cd /tmp && ls ncu_*.csv 2>/dev/null)
  [[ -n $csvs ]] && tar czf "$OUT/ncu_csv.tgz" -C /tmp $csvs
  if [[ ${PROFILE_DURATIONS:-1} != 0 ]]; then
    echo "===== durations (ns)" >> "$OUT/ncu_profile.txt"
    timeout 120 "$ncu" --clock-control none --cache-control "${PROFILE_CACHE:-all}" --metrics gpu__time_duration.sum --csv \
      python3 scripts/profile_tile.py --T "${PROFILE_T:-8,64,8192}" --ops pre,post_pre,head 2>&1 | grep "spk::" \
      | awk -F'","' '{print $5, $NF}' | sed 's/"$//' >> "$OUT/ncu_profile.txt"
    sed -n '/===== durations/,$p' "$OUT/ncu_profile.txt" | head -120
  fi
  # The fused boundaries across the GPUs: each kernel's duration and the gaps between them.
  if [[ ${PROFILE_SP:-1} != 0 ]]; then
    echo "===== fused boundaries (torch.profiler)" >> "$OUT/ncu_profile.txt"
    timeout 120 python3 scripts/profile_sp.py --T 8,64,8192 >> "$OUT/ncu_profile.txt" 2>&1
  fi
  grep -E "^=====|Duration|Registers Per|Achieved Occupancy|DRAM Throughput" "$OUT/ncu_profile.txt" | head -20
  sed -n '/^warp stall reasons/,/^=====/p' "$OUT/ncu_profile.txt" | head -50
  sed -n '/===== fused boundaries/,$p' "$OUT/ncu_profile.txt" | grep -v USDT | head -60
fi
if want sass && fits 30 sass; then
  # The extension's SASS for SASS_FILTER's kernels (a grep -E on the mangled names), into sass.txt.
  so=$(python3 -c "import glob, os, spkernels; print(glob.glob(os.path.join(os.path.dirname(spkernels.__file__), '_C*.so'))[0])")
  cuobjdump -sass "$so" 2>&1 | awk -v pat="${SASS_FILTER:-mhc_rows_kernel}" \
    '/Function :/ {keep = ($0 ~ pat)} keep' > "$OUT/sass.txt"
  grep -c "Function :" "$OUT/sass.txt"; wc -l "$OUT/sass.txt"
fi
if want probe && fits 60 probe; then  # bench/access_probe.cu: read bandwidth of the stream's access patterns
  nvcc -O3 -std=c++17 -arch=sm_90a bench/access_probe.cu -o /tmp/access_probe && timeout 120 /tmp/access_probe \
    | tee "$OUT/probe.txt"
fi
if want pp && fits 100 pp; then
  # Issue 7 measurement: PP2 x TP1 on 2 GPUs (v4.1), without and with microbatching.
  pp() { echo "=== $*" >> "$OUT/runner.log"; timeout ${RUNNER_TIMEOUT:-90} python3 -m spkernels.runner --device cuda --tp 1 --pp 2 \
            --arch v4.1 --preset v4-flash-like --quiet "$@" >> "$OUT/runner.log" 2>&1; echo "rc=$?" >> "$OUT/runner.log"; }
  pp --prompts 8 --prompt-len 2048 --gen 16 --warmup 1 --repeat 5 --microbatches 1
  pp --prompts 8 --prompt-len 2048 --gen 16 --warmup 1 --repeat 5 --microbatches 4
  pp --prompts 8 --prompt-len 2048 --gen 4 --microbatches 4 --check
  grep -E "^===|prefill|decode:|peak|rc=|Error|check" "$OUT/runner.log"
fi
exit $rc
