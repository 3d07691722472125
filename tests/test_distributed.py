"""graphattn.distributed: ring attention over MPI with 2, 3 and 4 ranks of one OpenMP thread each (each rank's
shard against the single-process call, f32 and bf16, causal or not, zigzag and contiguous, GQA, forward and
backward), a rank that fails, the torch.distributed adapter on gloo, and the layouts' row maps."""
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from graphattn import distributed as gd

HERE = pathlib.Path(__file__).resolve().parent
pytest.importorskip("mpi4py")


def _python_path(folder) -> str:
    """PYTHONPATH for a child: folder first, then this process's own (a build installed with pip --target)."""
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


def mpiexec() -> str:
    """mpiexec of this environment (the mpich wheel of the mpi extra), else from PATH."""
    local = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def run_ranks(count: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_python_path(HERE))
    return subprocess.run([mpiexec(), "-n", str(count), sys.executable, str(HERE / "ring_check.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ring_shards_match_the_single_process_call(ranks):
    result = run_ranks(ranks)
    assert result.returncode == 0, result.stdout + result.stderr
    # ranks print at once, so lines may interleave: each rank's report is found on its own
    assert sorted(int(r) for r in re.findall(r"rank (\d+): \d+ cases ok", result.stdout)) == list(range(ranks)), \
        result.stdout


def test_a_rank_with_a_bad_argument_fails_every_rank_alike():
    """A bad argument on one rank is found before any K/V moves: every rank raises the same error, naming it."""
    start = time.monotonic()
    result = run_ranks(3, "--fail-on-rank-1", timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("rank 1 of 3 failed: ValueError: layout must be one of") == 3, result.stderr
    assert "finished" not in result.stdout
    assert time.monotonic() - start < 30


def _refusals(text: str, ranks: int) -> list[str]:
    """The error each rank printed (ring_check.py's mismatch), in rank order."""
    found = dict(re.findall(r"rank (\d+) refused: (.*?the same options)", text))  # lines may interleave
    assert sorted(int(r) for r in found) == list(range(ranks)), text
    return [found[str(r)] for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("what, words", [("dtype", "query dtype: rank 0 has 'float32', rank 1 has 'float16'"),
                                         ("shape", "query shape: rank 0 has"), ("rows", "kv_bytes: rank 0 has"),
                                         ("causal", "is_causal: rank 0 has False, rank 1 has True")])
def test_ranks_whose_calls_disagree_all_raise_the_same_error(ranks, what, words):
    """dtypes, shapes of the same byte count, other K/V sizes, other flags: checked against each other once, at
    the start, so every rank raises the same ValueError (none exits 0 with garbage, none hangs)."""
    start = time.monotonic()
    result = run_ranks(ranks, f"--mismatch={what}", timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    messages = _refusals(result.stdout, ranks)
    assert len(set(messages)) == 1 and words in messages[0] and "the ranks' calls disagree" in messages[0], messages
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("ranks", [2, 3])
def test_an_interrupt_on_one_rank_ends_every_rank(ranks):
    """A KeyboardInterrupt (not an Exception) on rank 1 in its first kernel call aborts the ring: no rank hangs.
    With 3 ranks the others still wait for a hop rank 1 never sends, so none finishes; with 2, rank 0 may have
    had its one hop (the exchange runs beside the kernels) and finished with the right result before the abort."""
    start = time.monotonic()
    result = run_ranks(ranks, "--interrupt-on-rank-1", timeout=60)
    assert result.returncode != 0
    assert f"rank 1 of {ranks} failed: KeyboardInterrupt" in result.stderr, result.stderr
    finished = re.findall(r"rank (\d) finished", result.stdout)
    assert "1" not in finished and (ranks == 2 or not finished), result.stdout
    assert time.monotonic() - start < 30


def test_an_aborting_rank_waits_until_its_message_left_the_pipe():
    """MPI_Abort kills the process manager that forwards stderr: the message must be read from the pipe first."""
    import threading
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as stream, os.fdopen(read_end, "rb") as reader:
        start = time.monotonic()
        gd._wait_until_read(stream)  # an empty pipe: at once
        assert time.monotonic() - start < 0.5
        stream.write("rank 1 of 3 failed")
        stream.flush()
        got = []
        reading = threading.Timer(0.3, lambda: got.append(os.read(reader.fileno(), 100)))
        reading.start()
        start = time.monotonic()
        gd._wait_until_read(stream)
        waited = time.monotonic() - start
        reading.join()
        assert got == [b"rank 1 of 3 failed"] and 0.25 < waited < gd._DRAIN_SECONDS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_process_group_adapter_with_autograd():
    pytest.importorskip("torch")
    for code, out, err in _gloo_ranks(timeout=300):
        assert code == 0, out + err
        assert "cases and autograd ok" in out


def _gloo_ranks(*args: str, timeout: float = 60) -> list[tuple[int, str, str]]:
    """ring_check.py --torch on two gloo ranks: (return code, stdout, stderr) of each, within the timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_python_path(HERE), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, str(HERE / "ring_check.py"), "--torch", *args],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(ranks, outputs)]


@pytest.mark.parametrize("what", ["dtype", "shape", "rows", "causal"])
def test_gloo_ranks_whose_calls_disagree_all_raise_the_same_error(what):
    pytest.importorskip("torch")
    results = _gloo_ranks(f"--mismatch={what}")
    messages = []
    for code, out, err in results:
        assert code == 0, out + err
        messages += re.findall(r"rank \d refused: (.*)", out)
    assert len(messages) == 2 and messages[0] == messages[1] and "the ranks' calls disagree" in messages[0], messages


def test_gloo_interrupt_on_one_rank_ends_both():
    pytest.importorskip("torch")
    start = time.monotonic()
    results = _gloo_ranks("--interrupt-on-rank-1")
    assert results[1][0] != 0, results
    assert "rank 1 of 2 failed: KeyboardInterrupt" in results[1][2], results[1][2]
    assert "finished" not in results[1][1]
    assert time.monotonic() - start < 30


class _Ranks:
    """A communicator stand-in for the row maps: rank r of `size`, allgather over precomputed shards."""

    def __init__(self, rank, size, shards=None):
        self.rank, self.size, self.shards = rank, size, shards

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Sendrecv(self, *args, **kwargs):
        raise AssertionError("not used by the row maps")

    def allgather(self, _value):
        return self.shards


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_positions_and_unshard_cover_the_sequence(layout):
    size, length = 3, 24
    x = np.arange(2 * length * 5, dtype=np.float32).reshape(2, length, 5)
    rows = [gd.positions(length, _Ranks(r, size), layout) for r in range(size)]
    assert sorted(np.concatenate(rows).tolist()) == list(range(length))
    if layout == "zigzag":
        assert rows[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of 6
    shards = [gd.shard(x, _Ranks(r, size), layout) for r in range(size)]
    for r in range(size):
        np.testing.assert_array_equal(shards[r], x[:, rows[r], :])
    np.testing.assert_array_equal(gd.unshard(shards[1], _Ranks(1, size, shards), layout), x)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_calls_cover_each_visible_key_once_in_one_call_per_zigzag_step(size):
    """Each step's calls, expanded to (query row, key row) pairs of a chunk length of 3, are the causal pairs of
    the shards' global rows; a zigzag rank makes one call per step."""
    chunk, length = 3, 2 * size * 3
    for rank in range(size):
        mine = gd.positions(length, _Ranks(rank, size))
        seen = set()
        for step in range(size):
            source = (rank - step) % size
            theirs = gd.positions(length, _Ranks(source, size))
            calls = list(gd._calls(rank, source, size, "zigzag", True))
            assert len(calls) == 1, calls
            for first, count, keys, causal in calls:
                q_rows, k_rows = mine[first * chunk:(first + count) * chunk], theirs[:keys * chunk]
                for x, qr in enumerate(q_rows):  # bottom-right: row x sees keys up to x + len(k) - len(q)
                    for y, kr in enumerate(k_rows):
                        if not causal or y <= x + len(k_rows) - len(q_rows):
                            assert (qr, kr) not in seen
                            seen.add((qr, kr))
        assert seen == {(qr, kr) for qr in mine for kr in range(length) if kr <= qr}, f"rank {rank} of {size}"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="does not cut into 6 equal chunks"):
        gd.positions(25, _Ranks(0, 3))
    with pytest.raises(ValueError, match="layout must be one of"):
        gd.positions(24, _Ranks(0, 3), layout="striped")
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator"):
        gd.positions(24, object())


def test_ring_profile_accounts_each_ranks_time():
    script = HERE.parent / "benchmarks" / "ring_profile.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_python_path(script.parent))
    result = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), "--seq", "256", "--heads", "2",
                             "--head-dim", "16", "--dtype", "f32"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["rank"], r["pass"]) for r in rows) == [(0, "backward"), (0, "forward"), (1, "backward"),
                                                            (1, "forward")]
    for r in rows:
        assert r["kernel_ms"] > 0 and any(kind == "kernel" for kind, _ in r["events"])
        parts = r["kernel_ms"] + r["merge_ms"] + r["wait_ms"] + r["other_ms"]
        assert parts == pytest.approx(r["total_ms"], abs=0.5)


def test_ring_bench_takes_medians_over_alternating_rounds():
    script = HERE.parent / "benchmarks" / "ring_bench.py"
    env = dict(os.environ, PYTHONPATH=_python_path(script.parent))
    result = subprocess.run([sys.executable, str(script), "--ranks", "2", "--threads", "1", "--seq", "256", "--heads",
                             "2", "--head-dim", "16", "--dtypes", "f32", "--repeats", "1", "--rounds", "2"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["bench"] for r in rows] == ["ring_forward", "ring_backward"]
    for r in rows:
        assert r["rounds"] == 2 and len(r["round_ratios"]) == 2
        assert r["ratio"] == pytest.approx(float(np.median(r["round_ratios"])))
        assert r["single_ms"] > 0 and r[r["bench"][5:] + "_ms"] > 0


def test_example_runs_on_two_ranks():
    example = HERE.parent / "examples" / "ring_attention.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(example), "--seq", "512"], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(re.findall(r"rank \d of 2: .*? matches the single-process call", result.stdout)) == 2, result.stdout
