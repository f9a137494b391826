#!/usr/bin/env bash
# Runs test files (or node ids) RUNS times each, COPIES at once (a loaded machine: they
# compete, as the suite's workers do), with BUSY CPU-bound loops beside them, and prints
# one line per run: the file, the run, passed/failed and the failed tests.
#
#   RUNS=5 COPIES=2 BUSY=1 scripts/flake-hunt.sh tests/e2e/test_fail_slow.py tests/e2e/test_goodput_jobs.py
#
# Each copy gets its own --basetemp (kept under $OUT, default /tmp/flake-hunt) to read
# the summaries of a failed run afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
COPIES=${COPIES:-1}
BUSY=${BUSY:-0}
OUT=${OUT:-/tmp/flake-hunt}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
busy=()
for _ in $(seq "$BUSY"); do
  timeout 7200 "$PY" -c "while True: pass" & busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
for target in "$@"; do
  name=$(basename "${target%%::*}" .py)
  run=0
  while [ "$run" -lt "$RUNS" ]; do
    pids=()
    for _ in $(seq "$COPIES"); do
      [ "$run" -lt "$RUNS" ] || break
      run=$((run + 1))
      dir="$OUT/$name-$run"
      rm -rf "$dir"
      PERFMON_REQUIRE_EBPF=1 "$PY" -m pytest -q -p no:cacheprovider --basetemp "$dir" "$target" \
        > "$OUT/$name-$run.log" 2>&1 &
      pids+=("$!:$run")
    done
    for entry in "${pids[@]}"; do
      pid=${entry%%:*}; n=${entry##*:}
      if wait "$pid"; then
        echo "$name run $n: passed"
      else
        echo "$name run $n: FAILED $(grep -E '^FAILED' "$OUT/$name-$n.log" | cut -d' ' -f2 | tr '\n' ' ')"
      fi
    done
  done
done
