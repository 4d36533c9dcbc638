import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests._dist import Pools  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """`pools(world_size)` gives a live pool of gloo workers (see tests/_dist.py)."""
    p = Pools()
    yield p
    p.close()
