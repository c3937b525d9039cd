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
