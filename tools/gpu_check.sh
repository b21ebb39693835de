#!/usr/bin/env bash
# Check a tree on a GPU machine: build, GPU test suite, benchmarks; logs and results under $OUT.
#
#   bash tools/gpu_check.sh [PARTS] [pytest args...]
#
# PARTS is a comma list of (default: build,test,bench)
#   build     pip install --no-build-isolation -e . (log: $OUT/build.log)
#   test      the GPU suite, `pytest -m gpu tests` or the pytest args given ($OUT/pytest_gpu.log)
#   bench     python bench/collectives.py $BENCH_ARGS (default --quick) into $OUT
#   runner    the model runner's prefill and decode figures at tp = every GPU ($OUT/runner.log)
#   ab        the same bench on this tree and on every source tree under $AB_DIR (default .ab/),
#             each built in place; bench/compare.py prints the table ($OUT/ab_table.txt). Make a
#             tree with: mkdir -p .ab/NAME && git archive REF | tar -x -C .ab/NAME &&
#             git rev-parse --short REF > .ab/NAME/COMMIT
#   sanitize  tools/sanitize.sh (compute-sanitizer over every kernel)
#   wheel     tools/check_wheel.sh (build, install into a fresh venv, smoke test)
# $OUT defaults to ./gpu_out; SPK_COMMIT names the tree (default: git HEAD). A summary of every part (pass/fail lines) goes to $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
parts=${1:-build,test,bench}; shift || true
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
want() { [[ ,$parts, == *,$1,* ]]; }
note() { echo "$*" | tee -a "$summary"; }
rc=0

commit=${SPK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
note "gpu_check $parts at $commit on $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$summary" 2>&1

ab_trees=()
export SPK_BENCH_PROBES=${SPK_BENCH_PROBES:-1}  # the bench-only link probe: bench/sweep.py's link floors
if want ab; then  # build the other trees while this one builds
  for d in "${AB_DIR:-.ab}"/*/; do
    [[ -f $d/COMMIT ]] || continue
    ab_trees+=("${d%/}")
    (cd "$d" && "$PYTHON" setup.py build_ext --inplace > build.log 2>&1; echo $? > build.rc) &
  done
fi
if want build; then
  if ! "$PYTHON" -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; note "build: FAILED"; exit 1
  fi
  note "build: ok"
  "$PYTHON" -m spkernels.env >> "$summary" 2>&1
fi
if want test; then
  args=("$@"); (( ${#args[@]} )) || args=(-m gpu tests)
  # A broken barrier then shows as a timeout error, not as a hang of the whole suite.
  SPK_BARRIER_TIMEOUT=${SPK_BARRIER_TIMEOUT:-30} "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 "${args[@]}" \
    > "$OUT/pytest_gpu.log" 2>&1
  r=$?; (( r )) && rc=$r
  note "gpu suite (rc=$r): $(tail -1 "$OUT/pytest_gpu.log")"
fi
if want bench; then
  eval "bench_args=(${BENCH_ARGS:---quick})"
  "$PYTHON" bench/collectives.py "${bench_args[@]}" --out "$OUT" > "$OUT/bench.log" 2>&1 || { rc=1; note "bench: FAILED"; }
  tail -40 "$OUT/bench.log"
fi
if want ab; then
  wait
  eval "ab_args=(${AB_ARGS:-${BENCH_ARGS:---quick}})"
  ab_bench() {  # DIR NAME COMMIT: that tree's bench on that tree's build -> $OUT/ab_NAME.json
    (cd "$1" && export PYTHONPATH=$PWD/python &&
      "$PYTHON" -c "import spkernels, sys; sys.exit(not spkernels.__file__.startswith('$PWD/'))" &&
      "$PYTHON" bench/collectives.py "${ab_args[@]}" --out "$OUT" --name "ab_$2" --commit "$3") > "$OUT/ab_$2.log" 2>&1
  }
  results=()
  ab_bench "$PWD" this "$commit" && results+=("$OUT/ab_this.json")
  for d in "${ab_trees[@]}"; do
    name=$(basename "$d")
    if [[ $(cat "$d/build.rc") != 0 ]]; then note "ab $name: build FAILED"; continue; fi
    ab_bench "$PWD/$d" "$name" "$(cat "$d/COMMIT")" && results+=("$OUT/ab_$name.json") || note "ab $name: bench FAILED"
  done
  (( ${#results[@]} )) && "$PYTHON" bench/compare.py "${results[@]}" | tee "$OUT/ab_table.txt"
fi
if want runner; then
  tp=$(nvidia-smi -L | wc -l)
  runner() { echo "=== --tp $tp $*" >> "$OUT/runner.log"
    "$PYTHON" -m spkernels.runner --device cuda --tp "$tp" --preset v4-flash-like --quiet "$@" >> "$OUT/runner.log" 2>&1
    echo "rc=$?" >> "$OUT/runner.log"; }
  runner --prompt-lens 8192,8192 --gen 2 --warmup 1 --repeat 5 --sp-threshold 1024
  runner --prompt-lens 8192,8192 --gen 2 --warmup 1 --repeat 5 --sp-threshold none
  runner --prompts 16 --prompt-len 64 --gen 24 --warmup 1 --repeat 5
  runner --prompts 16 --prompt-len 64 --gen 24 --warmup 1 --repeat 5 --no-graphs
  grep -E "^===|prefill|decode:|rc=|Error" "$OUT/runner.log" | tee -a "$summary"
fi
if want sanitize; then
  OUT=$OUT bash tools/sanitize.sh ${SAN_TOOLS:-memcheck} | tail -3 | tee -a "$summary"
fi
if want wheel; then
  bash tools/check_wheel.sh > "$OUT/wheel.log" 2>&1 && note "wheel: ok" || { rc=1; note "wheel: FAILED"; }
fi
exit $rc
