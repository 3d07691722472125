"""Every Python example runs and checks itself against the NumPy reference."""
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["sdpa.py", "gqa.py", "mqa.py", "sdpa_bottom_right_causal_mask.py"]


def run(script, *args):
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                            cwd=EXAMPLES, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, dtype):
    out = run(script, "--dtype", dtype)
    assert "1 partition(s)" in out and "matches the NumPy reference" in out


@pytest.mark.parametrize("args", [[], ["--causal", "--dtype", "bf16"]])
def test_demo_runs(args):
    out = run("demo.py", "--seq", "256", "--heads", "4", "--repeats", "2", *args)
    assert "1 partition(s)" in out and "matches the op-by-op NumPy reference" in out and "GFLOP/s" in out


def test_info_command():
    result = subprocess.run([sys.executable, "-m", "graphattn", "info"], capture_output=True, text=True)
    assert result.returncode == 0 and "graphattn 0.1.0" in result.stdout and "openmp threads:" in result.stdout
