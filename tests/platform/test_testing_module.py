"""``pointerdomain.testing``: the public test doubles work as the platform layer's do."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import FaultyBackend, backend_for, install_backend

DEV = pd.Device("emulated", 0)


def test_a_faulty_backend_fails_the_chosen_call_and_leaves_memory_unregistered() -> None:
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    with install_backend(FaultyBackend(backend_for(DEV), fail={"register": {1: 2}}), "emulated"):
        with pytest.raises(errors.RegistrationError):
            pd.register_host_tensor(buf, DEV)
    assert pd.find_registration(pd.HostVA(buf.data_ptr())) is None
    mem = pd.register_host_tensor(buf, DEV)  # the real backend is back
    try:
        assert pd.find_registration(pd.HostVA(buf.data_ptr())) is mem
    finally:
        mem.close()


def test_native_doubles_load_on_first_use_and_unknown_names_raise() -> None:
    import pointerdomain.testing as testing

    assert testing.EmulatedBackend.__name__ == "EmulatedBackend"
    with pytest.raises(AttributeError):
        getattr(testing, "NoSuchDouble")


def test_tests_outside_the_platform_folder_use_the_public_testing_module() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(r"^\s*(from|import)\s+pointerdomain\._platform\b", re.MULTILINE)
    found = sorted(
        str(path.relative_to(root)) for path in root.rglob("*.py")
        if path.parent.name != "platform" and pattern.search(path.read_text())
    )
    assert found == [], found


def test_the_testing_module_names_the_platform_helpers_tests_need(monkeypatch: pytest.MonkeyPatch) -> None:
    import pointerdomain.testing as testing

    plan = testing.kernel_plan(0, (0,) * 8, 0, (0,) * 8, 1, 1, 1, 1)
    assert isinstance(plan, testing.KernelPlan)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # cuda:<current> where CUDA is there
    assert testing.default_device() == pd.Device("emulated", 0)  # without a GPU: the CPU stand-in
    assert callable(testing.load_cudart)
    assert testing.NOT_REGISTERED == 713 and testing.NOT_SUPPORTED == 801
