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
for name in fedavg_round fednas_search dfnas_cost perfedrlnas_cost elastic_single_path clients_in_flight \
            multiprocess_round api_memory gpu jax_versions; do
  t=$SECONDS
  if "$PY" "benchmarks/$name.py" --quick --out "$out" > "$logs/$name.log" 2>&1; then
    echo "ok      benchmarks/$name.py --quick ($((SECONDS - t)) s)"
  else
    echo "FAILED  benchmarks/$name.py --quick ($((SECONDS - t)) s); the end of its output:"
    tail -n 40 "$logs/$name.log" | sed 's/^/    /'
    failed+=("$name")
  fi
done
echo "total $((SECONDS - start)) s; results in $out, logs in $logs"
if ((${#failed[@]})); then
  echo "failed: ${failed[*]}"
  exit 1
fi
