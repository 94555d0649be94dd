import os

import torch

# Tests measure no speed; two threads keep them predictable on the 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# A run samples other work on the cores for a second at its start (harness.measure.busy);
# the suite's many small runs take a fifth of it. The tests of the sampler pass their own.
os.environ.setdefault("ATTNBENCH_BUSY_WINDOW_S", "0.2")


import pytest  # noqa: E402

from harness.measure.worker import EXTRA_ENV  # noqa: E402
from variants.core import modules, registry  # noqa: E402
from small_rates import small_matmul  # noqa: E402 (tests/ is on sys.path)


@pytest.fixture(autouse=True)
def _variant_modules_stay_in_their_test():
    """A test that runs a command in this process with --variant-module (or a TOML's
    `modules`) registers that module's variants, records it as loaded and names it in
    ATTNBENCH_EXTRA_MODULES, as the command does for its lifetime; here the registry, the
    loaded modules and the variable are put back after each test, so no later test sees
    another's variants (nor a meta.json that lists them)."""
    extra = os.environ.get(EXTRA_ENV)
    tables = registry._REGISTRY, registry._ORIGIN, modules._LOADED
    kept = [dict(t) for t in tables]
    yield
    if extra is None:
        os.environ.pop(EXTRA_ENV, None)
    else:
        os.environ[EXTRA_ENV] = extra
    for table, saved in zip(tables, kept):
        table.clear()
        table.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _small_matmul_rate():
    """Every run in this process times its matmul rate small (small_matmul): a run samples
    the rate at its start, before each later round and at its end, about a second a sample
    at full size, and the suite's in-process runs read the rate only as a number in their
    meta and report. Session-scoped, so module-scoped runs (fixtures) get it too.
    Subprocesses and jobs the tests start measure theirs at full size, as a run does."""
    with pytest.MonkeyPatch.context() as mp:
        small_matmul(mp)
        yield
