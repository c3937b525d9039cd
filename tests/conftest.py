from collections.abc import Iterator

import pytest
import torch

from pointerdomain import checked


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu-check on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _checked_mode() -> Iterator[None]:
    """Every test launches in checked mode: each address a launch touches is verified
    against the registry first (tests that measure or toggle it set it themselves)."""
    previous = checked.enabled()
    checked.set_enabled(True)
    yield
    checked.set_enabled(previous)
