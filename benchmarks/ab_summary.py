"""Summary of an A/B of two builds (ab_builds.sh): per case, the median time over rounds of each build, the
new/old ratio, and the larger of the two builds' A/A spreads (max/min over their rounds); a case is flagged
SLOWER where new/old exceeds that spread by more than 3%.

    python benchmarks/ab_summary.py DIR      (DIR holds <build>.<round>.<suite>.jsonl, build old or new)
"""
from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import sys

MARGIN = 1.03  # slower than the A/A spread by more than this counts


def load(directory: str) -> dict:
    """{(pass, shape, dtype, causal): {"old": [ms, ...], "new": [...]}} from sdpa_bench.py's JSON lines."""
    runs: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        build = os.path.basename(path).split(".")[0]
        with open(path) as lines:
            for line in lines:
                if not line.startswith("{"):
                    continue  # the table after the JSON lines
                row = json.loads(line)
                if row.get("bench") in ("sdpa_forward", "sdpa_backward"):
                    key = (row["bench"][len("sdpa_"):], tuple(row["shape"]), row["dtype"], row["causal"])
                    runs[key][build].append(row["graphattn_ms"])
    return runs


def compare(runs: dict) -> list[dict]:
    """One row per case both builds timed: medians, ratio, spread and whether it is flagged."""
    rows = []
    for key in sorted(runs):
        old, new = runs[key]["old"], runs[key]["new"]
        if old and new:
            ratio = statistics.median(new) / statistics.median(old)
            spread = max(max(old) / min(old), max(new) / min(new))
            rows.append({"case": key, "old_ms": statistics.median(old), "new_ms": statistics.median(new),
                         "ratio": ratio, "spread": spread, "slower": ratio > spread * MARGIN})
    return rows


def main() -> None:
    rows = compare(load(sys.argv[1]))
    for r in rows:
        kind, shape, dtype, causal = r["case"]
        print(f"{kind:8s} {str(shape):28s} {dtype:5s} {'causal' if causal else 'plain ':6s} old {r['old_ms']:9.4f} "
              f"new {r['new_ms']:9.4f} new/old {r['ratio']:5.3f} spread {r['spread']:5.3f}"
              f"{'  SLOWER' if r['slower'] else ''}")
    if rows:
        ratios = [r["ratio"] for r in rows]
        print(f"cases {len(rows)}, new/old median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}; slower than {MARGIN - 1:.0%} beyond the A/A spread: "
              f"{sum(r['slower'] for r in rows)}")


if __name__ == "__main__":
    main()
