#!/usr/bin/env bash
# Runs every user benchmark with --quick (its smallest configuration: every code path of the
# script in seconds) and exits non-zero if any of them fails. What CI runs to keep the
# benchmarks working; the numbers mean nothing. Results go to one file in a temporary
# directory (or the file given as $1), never to benchmarks/RESULTS.md.
#
#   benchmarks/quick.sh [RESULTS_FILE]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
out="${1:-$(mktemp -d)/quick-results.md}"
logs="$(mktemp -d)"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export JAXFEDNAS_CACHE=off  # every compile counted, as on a fresh CI machine
failed=()
start=$SECONDS
# Two at a time (QUICK_JOBS): each is one process that mostly compiles, on one core. Longest
# first; each writes its own results file, appended to $out in this order at the end.
names=(gpu dfnas_cost fednas_search jax_versions perfedrlnas_cost elastic_single_path api_memory \
       clients_in_flight fedavg_round multiprocess_round)
run_one() {
  local name=$1 t=$SECONDS
  if "$PY" "benchmarks/$name.py" --quick --out "$logs/$name.md" > "$logs/$name.log" 2>&1; then
    echo "ok      benchmarks/$name.py --quick ($((SECONDS - t)) s)" > "$logs/$name.status"
  else
    echo "FAILED  benchmarks/$name.py --quick ($((SECONDS - t)) s); the end of its output:" > "$logs/$name.status"
  fi
}
for name in "${names[@]}"; do
  while (( $(jobs -rp | wc -l) >= ${QUICK_JOBS:-2} )); do wait -n || true; done
  run_one "$name" &
done
wait
for name in "${names[@]}"; do
  cat "$logs/$name.status"
  if grep -q '^FAILED' "$logs/$name.status"; then
    tail -n 40 "$logs/$name.log" | sed 's/^/    /'
    failed+=("$name")
  fi
  [ -f "$logs/$name.md" ] && cat "$logs/$name.md" >> "$out"
done
echo "total $((SECONDS - start)) s; results in $out, logs in $logs"
if ((${#failed[@]})); then
  echo "failed: ${failed[*]}"
  exit 1
fi
