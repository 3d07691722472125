"""Helper for tests whose setting is fixed at thread start (OMP_NUM_THREADS) or that read a fresh process's log."""
import os
import subprocess
import sys

from cpu_helpers import skip_unless_runs_here


def run_python_logged(script: str, kernel: str | None = None, **env: str) -> tuple[str, str]:
    """Runs `script` in a fresh Python with these environment variables added, scratch poisoned as in this
    process, the kernel candidate `kernel` forced on both passes where given (graphattn.force_kernel); asserts it
    exits 0 and returns its standard output and standard error (where the verbose log goes).  The calling test
    skips, saying why, where this CPU cannot run the forced kernel."""
    if kernel is not None:
        skip_unless_runs_here(kernel)
    prelude = "import graphattn._cpu\ngraphattn._cpu.poison_scratch(True)\n"  # as conftest.py does here
    if kernel is not None:
        prelude += f"import graphattn\ngraphattn.force_kernel({kernel!r})\n"
    script = prelude + script
    result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **env), capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def run_python(script: str, kernel: str | None = None, **env: str) -> str:
    """run_python_logged's standard output alone."""
    return run_python_logged(script, kernel, **env)[0]
