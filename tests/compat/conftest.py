"""The compat room: every engine call shape also runs in strict alias mode in CI
(``python -m pytest -m strict_alias --strict-alias``): an engine table holding a host VA
where a device alias belongs faults there."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOM = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ROOM in item.path.resolve().parents:
            item.add_marker(pytest.mark.strict_alias)
