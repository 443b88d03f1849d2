"""Session-wide rank pools at world sizes 2 and 4 (gloo on CPU), started lazily and reused."""

import pytest

from tests.rank_pool import RankPool

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
