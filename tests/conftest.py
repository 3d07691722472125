import os
import random

import numpy as np
import pytest

from graphattn import _cpu

# Scratch the kernels do not clear starts as NaN in every test (native/cpu/src/scratch.hpp), so that a
# kernel reading scratch it never wrote shows in its results; subprocess_helpers does the same in children.
_cpu.poison_scratch(True)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run every test marked slow")
    parser.addoption("--run-sanitizer", action="store_true",
                     help="run the tests marked sanitizer (a rebuild under ASan/UBSan: minutes; .ci/run's own job)")


def pytest_collection_modifyitems(config, items):
    """Tests marked sanitizer run only with --run-sanitizer (their rebuild would double the suite's time).
    Without --run-slow, run a fixed sample of the slow cases (GRAPHATTN_SLOW_SAMPLE, default 120)."""
    if not config.getoption("--run-sanitizer"):
        skip = pytest.mark.skip(reason="sanitizer job: run with --run-sanitizer (.ci/run does, in its own budget)")
        for item in items:
            if "sanitizer" in item.keywords:
                item.add_marker(skip)
    if config.getoption("--run-slow"):
        return
    slow = [item for item in items if "slow" in item.keywords]
    keep = set(random.Random(0).sample(range(len(slow)), min(len(slow), int(os.environ.get("GRAPHATTN_SLOW_SAMPLE", 120)))))
    skip = pytest.mark.skip(reason="slow case outside the sample; run with --run-slow")
    for index, item in enumerate(slow):
        if index not in keep:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
