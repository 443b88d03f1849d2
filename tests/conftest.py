"""Session-wide rank pools at world sizes 2 and 4 (gloo on CPU), started lazily and reused."""

import pytest

from tests.support.rank_pool import RankPool

_pools: dict[int, RankPool] = {}


def get_pool(world: int) -> RankPool:
    if world not in _pools:
        _pools[world] = RankPool(world)
    return _pools[world]


@pytest.fixture(params=[2, 4], ids=["ws2", "ws4"])
def pool(request) -> RankPool:
    """Each test using ``pool`` runs once per world size."""
    return get_pool(request.param)


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()


# ---- one-device tests (tests/test_gpu.py): --device and the ``gpu`` marker
def pytest_addoption(parser):
    parser.addoption("--device", default=None,
                     help="device type of the one-device tests (default cpu; the tests marked gpu default to cuda, "
                          "are skipped without it, and run on the CPU with --device cpu)")


def one_device(config, gpu: bool) -> str:
    """The device type a one-device test runs on: ``--device``, else cuda for ``gpu`` tests, cpu otherwise."""
    return config.getoption("--device") or ("cuda" if gpu else "cpu")


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        kind = one_device(config, True)
        if kind != "cpu" and not (torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == kind):
            needs = "needs CUDA" if kind == "cuda" else f"needs a {kind} device"
            item.add_marker(pytest.mark.skip(reason=f"{needs}; --device cpu runs these tests on the CPU"))


@pytest.fixture
def device(request) -> str:
    """The device type of a one-device test (see ``--device``)."""
    return one_device(request.config, request.node.get_closest_marker("gpu") is not None)
