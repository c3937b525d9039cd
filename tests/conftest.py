from collections.abc import Iterator

import pytest
import torch

from tests.helpers.fixtures import checked_launches  # noqa: F401 -- autouse for every test


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu-check on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--strict-alias", action="store_true", default=False,
        help="run every test in strict alias mode (pointerdomain.strict_alias): host memory the library "
        "allocates is mapped twice, so a host VA handed to a GPU kernel faults",
    )


@pytest.fixture(autouse=True)
def _strict_alias_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    """``--strict-alias`` switches strict alias mode on for every test (tests that set it
    themselves, such as tests/registration/test_strict_alias.py, do so inside)."""
    import pointerdomain as pd

    if not request.config.getoption("--strict-alias"):
        yield
        return
    with pd.strict_alias(True):
        yield
