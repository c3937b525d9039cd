"""The typing suite (mypy and pyright over typing_tests/cases, the pass files run) is
``slow``: a cold mypy run spends minutes in torch's annotations on a busy 2-core machine,
so the fast suite leaves it out and .ci/run's typing stage runs it
(``python -m pytest -q -m slow typing_tests``)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.slow)
