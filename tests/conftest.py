import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# One thread per xdist worker: two workers on two cores each wanting two threads slow
# small ops down many times over.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

settings.register_profile(
    "default", max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def one_thread():
    """For tests of thousands of tiny steps: a second intra-op thread only adds wake-ups."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the tests marked slow (the long audit)")


def pytest_configure(config):
    if config.getoption("--runslow"):
        os.environ.setdefault("DPOPTIM_LONG_AUDIT", "1")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
