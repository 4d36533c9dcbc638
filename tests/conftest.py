import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests._dist import ENV_VAR, PlacementUnavailable, Pools, choose_placement, cuda_device_count  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "device_agnostic: the test's rank functions follow tests._dist.device(), so its pools may run on "
        "CUDA + NCCL (see tests/_dist.py)")


@pytest.fixture(scope="session")
def _pool_registry():
    p = Pools()
    yield p
    p.close()


@pytest.fixture
def pools(request, _pool_registry):
    """`pools(world_size)` gives a live pool of workers, one per rank (see tests/_dist.py): CPU + gloo, or
    CUDA + NCCL for tests marked `device_agnostic` where the machine has a GPU per rank."""
    agnostic = request.node.get_closest_marker("device_agnostic") is not None
    requested = os.environ.get(ENV_VAR, "auto") if agnostic else "cpu"

    def get(world_size: int):
        try:
            placement = choose_placement(world_size, requested, cuda_device_count() if requested != "cpu" else 0)
        except PlacementUnavailable as e:
            pytest.skip(str(e))
        return _pool_registry(world_size, placement)

    return get
