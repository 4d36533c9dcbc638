import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests._dist import ENV_VAR, PlacementUnavailable, Pools, choose_placement, cuda_device_count  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "device_agnostic: the test's rank functions follow tests._dist.device(), so its pools may run on "
        "CUDA + NCCL (see tests/_dist.py)")


# What the running test may use: "cpu" unless it is marked device_agnostic (then HF_ZERO_TEST_DEVICE, default
# auto). Set around each test by the autouse fixture below, so a module-scoped fixture that asks for a pool
# while no test runs gets CPU + gloo.
_REQUESTED = {"device": "cpu"}


@pytest.fixture(autouse=True)
def _placement_request(request):
    agnostic = request.node.get_closest_marker("device_agnostic") is not None
    _REQUESTED["device"] = os.environ.get(ENV_VAR, "auto") if agnostic else "cpu"
    yield
    _REQUESTED["device"] = "cpu"


@pytest.fixture(autouse=True)
def _in_process_on_the_host(monkeypatch):
    """Tests that call `hf_zero.initialize` in the test process (no torch.distributed) compare with references on
    the host: on a machine with a GPU the engine would take it ([Note: compute device]), so here it sees none. The
    pools choose their own placement."""
    from hf_zero.engine import placement

    monkeypatch.setattr(placement, "_process_accelerator", lambda: None)


@pytest.fixture(scope="session")
def pools():
    """`pools(world_size)` gives a live pool of workers, one per rank (see tests/_dist.py): CPU + gloo, or
    CUDA + NCCL for tests marked `device_agnostic` where the machine has a GPU per rank."""
    registry = Pools()

    def get(world_size: int):
        requested = _REQUESTED["device"]
        try:
            placement = choose_placement(world_size, requested, cuda_device_count() if requested != "cpu" else 0)
        except PlacementUnavailable as e:
            pytest.skip(str(e))
        return registry(world_size, placement)

    yield get
    registry.close()
