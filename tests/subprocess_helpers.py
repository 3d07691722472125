"""Helper for tests whose setting is fixed at import or thread start (GRAPHATTN_ISA, OMP_NUM_THREADS, ...)."""
import os
import subprocess
import sys


def run_python(script: str, **env: str) -> str:
    """Runs `script` in a fresh Python with these environment variables added; asserts it exits 0 and returns
    its standard output."""
    result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **env), capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout
