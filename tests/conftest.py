import importlib.util
from collections.abc import Iterator

import pytest
import torch

from tests.helpers.fixtures import checked_launches  # noqa: F401 -- autouse for every test


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips, with the reason, what this machine cannot run: ``gpu`` tests without a CUDA
    device, ``requires_module(name, ...)`` tests without one of those modules."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu-check on a GPU machine)")
    cuda = torch.cuda.is_available()
    installed: dict[str, bool] = {}
    for item in items:
        if not cuda and "gpu" in item.keywords:
            item.add_marker(no_gpu)
        for mark in item.iter_markers("requires_module"):
            for name in mark.args:
                if name not in installed:
                    installed[name] = importlib.util.find_spec(name) is not None
            missing = [name for name in mark.args if not installed[name]]
            if missing:
                item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)}, not installed here (.ci/run "
                                                        "installs it for its engines stage)"))


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
