"""The benchmark runs end to end: JSON lines, the table, and per peer the count of cases under 1.0x and 1.3x."""
import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "sdpa_bench.py"


def test_benchmark_prints_rows_table_and_summary():
    result = subprocess.run([sys.executable, str(BENCH), "--suite", "quick", "--dtypes", "f32", "--only", "plain",
                             "--seconds", "0.01", "--no-peak"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [tuple(r["shape"]) for r in rows] == [(1, 16, 16, 1024, 1024, 64), (1, 2, 2, 2048, 2048, 64),
                                                  (1, 32, 8, 1, 4096, 128)]
    assert all(r["graphattn_ms"] > 0 and r["graphattn_gflops"] > 0 and r["isa"] for r in rows)
    assert any(line.startswith("pass     shape") for line in lines)
    peers = sorted({key[3:] for r in rows for key in r if key.startswith("vs_")})
    summaries = [line for line in lines if line.startswith("vs ")]
    assert [s.split(":")[0] for s in summaries] == [f"vs {peer}" for peer in peers]
    for peer, summary in zip(peers, summaries):
        below = sum(r["vs_" + peer] < 1.0 for r in rows)
        assert f": {below} of {len(rows)} cases below 1.0" in summary
