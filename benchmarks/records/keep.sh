#!/usr/bin/env bash
# keep.sh RUN_DIR DEST: copy the text files of a run directory's finished stages (each stage's
# config, summary, metrics and partition manifest; the seeds' tables, wall times and inherited
# accuracies), without checkpoints, plots or locks. A stage that has not finished (config.json
# but no summary.json) is left out: without its checkpoint it could not be resumed.
# `examples/<paper>.py ... --out COPY --resume` on a copy reads the finished stages from these
# files and runs only what is missing (docs/guides/outputs.md).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: keep.sh RUN_DIR DEST" >&2; exit 2; }
src=$1 dest=$2
[ -d "$src" ] || { echo "keep.sh: $src is not a directory" >&2; exit 2; }
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
cd "$src"
prune=()
while IFS= read -r d; do
    if [ ! -e "$d/summary.json" ]; then
        echo "keep.sh: $src/${d#./} has not finished: left out"
        prune+=(-path "$d" -prune -o)
    fi
done < <(find . -name config.json -printf '%h\n')
# (not STATUS.md: a run continued from a copy of a record holds the record's, older than DEST's)
find . "${prune[@]}" -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.txt' \
    -o -name '*.csv' \) ! -name STATUS.md -print0 | xargs -0 -r cp --parents -t "$dest"
