#!/usr/bin/env bash
# A/B of two graphattn builds on sdpa_bench.py's suites, each run in a process of its own, graphattn alone:
#
#   OLD=/path/to/old/site NEW=/path/to/new/site benchmarks/ab_builds.sh ROUNDS SECONDS SUITE...
#
# OLD and NEW are directories holding a built graphattn package (pip install --target DIR .); rounds alternate
# which build runs first. JSON lines go to $AB (default ./ab_runs) as <build>.<round>.<suite>.jsonl, then
# ab_summary.py prints each case's new/old ratio against its A/A spread.
set -euo pipefail
ROUNDS=$1; SECONDS_PER=$2; shift 2
AB=${AB:-ab_runs}; mkdir -p "$AB"
HERE=$(cd "$(dirname "$0")" && pwd)
for suite in "$@"; do
  for r in $(seq 1 "$ROUNDS"); do
    order="old new"; [ $((r % 2)) = 0 ] && order="new old"
    for b in $order; do
      site=$OLD; [ "$b" = new ] && site=$NEW
      PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 "$HERE/sdpa_bench.py" --suite "$suite" --peers "" \
        --no-peak --seconds "$SECONDS_PER" > "$AB/$b.$r.$suite.jsonl" 2> "$AB/$b.$r.$suite.err"
    done
  done
done
python3 "$HERE/ab_summary.py" "$AB"
