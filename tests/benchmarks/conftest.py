import pytest

RUN = "python -m pytest tests/benchmarks --benchmark-only"


def pytest_collection_modifyitems(config, items):
    """The default test command skips the micro benchmarks; `RUN` runs them."""
    if config.getoption("benchmark_only"):
        return
    skip = pytest.mark.skip(reason=f"micro benchmarks run on demand: {RUN}")
    for item in items:
        if "benchmarks" in item.path.parts:
            item.add_marker(skip)
