"""Helper for tests whose setting is fixed at import or thread start (GRAPHATTN_ISA, OMP_NUM_THREADS, ...)."""
import os
import subprocess
import sys


def run_python_logged(script: str, **env: str) -> tuple[str, str]:
    """Runs `script` in a fresh Python with these environment variables added; asserts it exits 0 and returns
    its standard output and standard error (where the verbose log goes)."""
    result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **env), capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def run_python(script: str, **env: str) -> str:
    """run_python_logged's standard output alone."""
    return run_python_logged(script, **env)[0]
