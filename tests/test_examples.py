"""Every example runs and checks itself: the Python ones against the NumPy reference, the C++ ones
(examples/cpp, built here with CMake) against a double-precision reference of their own."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["sdpa.py", "gqa.py", "mqa.py", "sdpa_bottom_right_causal_mask.py", "gqa_training.py"]
# Functional-API programs of the model families the score modifiers serve (no graph: no partition line).
MODEL_SCRIPTS = ["gemma2_attention.py", "gpt_oss_attention.py"]


def run(script, *args):
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                            cwd=EXAMPLES, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, dtype):
    out = run(script, "--dtype", dtype)
    assert "1 partition(s)" in out and ("matches the NumPy reference" in out or "match the NumPy reference" in out)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("script", MODEL_SCRIPTS)
def test_model_family_example_runs(script, dtype):
    out = run(script, "--dtype", dtype, "--seq", "192")
    layers = [line for line in out.splitlines() if line.strip().startswith("layer ")]
    assert len(layers) == 2 and all("matches the float64 reference" in line for line in layers), out


@pytest.mark.parametrize("args", [[], ["--causal", "--dtype", "bf16"]])
def test_demo_runs(args):
    out = run("demo.py", "--seq", "256", "--heads", "4", "--repeats", "2", *args)
    assert "1 partition(s)" in out and "matches the op-by-op NumPy reference" in out and "GFLOP/s" in out


def test_info_command():
    result = subprocess.run([sys.executable, "-m", "graphattn", "info"], capture_output=True, text=True)
    assert result.returncode == 0 and "graphattn 0.1.0" in result.stdout and "openmp threads:" in result.stdout


def test_info_reports_the_sycl_plugin_as_it_is():
    """Where the plugin is not installed, info says so and how to get it; where it loads, info lists dpctl's
    devices by their filter strings (the OpenCL CPU device in the SYCL job) and no longer says "none"."""
    import importlib.util
    result = subprocess.run([sys.executable, "-m", "graphattn", "info"], capture_output=True, text=True)
    line = [text for text in result.stdout.splitlines() if text.startswith("sycl")]
    assert len(line) == 1, result.stdout
    if importlib.util.find_spec("graphattn._sycl") is None:
        assert line[0] == ("sycl: the SYCL plugin is not part of this install; install graphattn with it: "
                           "GRAPHATTN_SYCL=1 pip install 'graphattn[sycl]'"), line
        return
    probe = subprocess.run([sys.executable, "-c", "from graphattn import sycl_runtime; sycl_runtime.plugin(); "
                            "import dpctl; print(' '.join(d.filter_string for d in dpctl.get_devices()))"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        assert line[0].startswith("sycl: ") and "plugin" in line[0], line
        return
    devices = probe.stdout.split()
    assert (line[0].startswith("sycl devices: ") and all(d in line[0] for d in devices)) if devices else \
        line[0] == "sycl: plugin built; dpctl sees no SYCL device", (line, devices)


def test_import_changes_no_environment_variable():
    """import graphattn (and its torch glue, and info) leaves os.environ as it was: the SYCL runtime's settings
    wait for the first use of SYCL."""
    script = ("import os, json; before = dict(os.environ); import graphattn, graphattn.torch, graphattn.distributed;"
              " import graphattn.__main__; graphattn.__main__.info; after = dict(os.environ);"
              " print(json.dumps({k: after.get(k) for k in set(before) ^ set(after) | "
              "{k for k in before if before[k] != after.get(k)}}))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k not in ("OCL_ICD_FILENAMES",
                                                                                  "SYCL_CACHE_PERSISTENT")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{}", result.stdout


def build_tool(name):
    """The tool from this environment (the test extra installs it), else from PATH."""
    local = pathlib.Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def test_cpp_examples_build_and_match(tmp_path):
    cmake, ninja = build_tool("cmake"), build_tool("ninja")
    if cmake is None or ninja is None:
        pytest.fail("cmake and ninja are needed to build the C++ examples: pip install '.[test]'")
    source = EXAMPLES.parent
    configure = [cmake, "-S", str(source), "-B", str(tmp_path), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                 "-DGRAPHATTN_BUILD_EXAMPLES=ON", "-DGRAPHATTN_BUILD_PYTHON=OFF"]
    for command in (configure, [cmake, "--build", str(tmp_path), "-j", str(os.cpu_count() or 2)]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    binaries = sorted((tmp_path / "examples" / "cpp").glob("example_*"))
    assert [b.name for b in binaries] == ["example_gqa_bf16_causal", "example_score_modifiers", "example_sdpa"]
    for binary in binaries:
        result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "matches the reference" in result.stdout and " ms" in result.stdout


def test_varlen_example_runs():
    out = run("varlen_packed.py", "--new-tokens", "3")
    assert "(matches)" in out and "greedy tokens match sdpa's" in out and "padding-free training" in out
