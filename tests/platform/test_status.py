"""Each runtime names its own status codes (``pointerdomain._platform.status``): a failure
on a HIP backend reads as ``hipError...``, on CUDA as ``cudaError...``, on the emulated
backend as its own; the codes the library acts on are the backend's table's."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain._platform.status import (
    CUDA_STATUS,
    EMULATED_STATUS,
    HIP_STATUS,
    MEMLOCK_EXCEEDED,
    check,
    registration_error,
    status_table,
)
from pointerdomain.testing import DriverFaults, FaultyBackend, backend_for, install_backend

DEV = pd.Device("emulated", 0)


class _Runtime(FaultyBackend):
    """The emulated backend's work under another runtime's name (and so its status table)."""

    def __init__(self, runtime: str, fail: dict[str, dict[int, int]]) -> None:
        super().__init__(backend_for(DEV), fail=fail)
        self.runtime = runtime

    def describe(self, code: int) -> str:
        return f"text of {code}"


def test_each_runtime_names_the_host_registration_codes_its_own_way() -> None:
    # The numbers agree (HIP took CUDA's), the names do not.
    for code in (712, 713, 2, 801, 900):
        assert HIP_STATUS.name(code).startswith("hipError"), code
        assert CUDA_STATUS.name(code).startswith("cudaError"), code
    assert HIP_STATUS.name(712) == "hipErrorHostMemoryAlreadyRegistered"
    assert CUDA_STATUS.name(712) == "cudaErrorHostMemoryAlreadyRegistered"
    assert HIP_STATUS.name(713) == "hipErrorHostMemoryNotRegistered"
    assert HIP_STATUS.name(2) == "hipErrorOutOfMemory" and CUDA_STATUS.name(2) == "cudaErrorMemoryAllocation"
    # one number, two meanings; and codes of one runtime only
    assert HIP_STATUS.name(201) == "hipErrorInvalidContext" and CUDA_STATUS.name(201) == "cudaErrorDeviceUninitialized"
    assert HIP_STATUS.name(1052) == "hipErrorRuntimeMemory" and CUDA_STATUS.name(1052) == "cuda status 1052"
    for table in (CUDA_STATUS, HIP_STATUS, EMULATED_STATUS):
        assert (table.already_registered, table.not_registered, table.out_of_memory) == (712, 713, 2)
    assert EMULATED_STATUS.memlock_exceeded == MEMLOCK_EXCEEDED and HIP_STATUS.memlock_exceeded is None
    assert status_table("hip") is HIP_STATUS and status_table("cuda") is CUDA_STATUS
    assert status_table("other").name(5) == "other status 5"


def test_backends_choose_their_table_by_runtime() -> None:
    assert backend_for(DEV).status is EMULATED_STATUS
    hip = _Runtime("hip", {})
    assert hip.status is HIP_STATUS
    # a wrapper takes the runtime (and so the table) of what it wraps
    assert DriverFaults(hip).status is HIP_STATUS
    assert _Runtime("cuda", {}).status is CUDA_STATUS


@pytest.mark.parametrize(("runtime", "name", "other"), [
    ("hip", "hipErrorHostMemoryAlreadyRegistered", "cuda"),
    ("cuda", "cudaErrorHostMemoryAlreadyRegistered", "hip"),
])
def test_a_refused_registration_reads_as_its_runtime(runtime: str, name: str, other: str) -> None:
    buf = torch.zeros(1 << 14, dtype=torch.uint8)
    with install_backend(_Runtime(runtime, {"register": {1: 712}}), "emulated"):
        with pytest.raises(errors.AlreadyRegisteredError) as info:
            pd.register_host_tensor(buf, DEV)
    text = str(info.value)
    assert f"({name}, error 712)" in text and other not in text.lower()
    assert pd.find_registration(pd.HostVA(buf.data_ptr())) is None  # nothing stayed registered


def test_a_hip_out_of_memory_under_a_low_memlock_is_a_memlock_error_named_as_hip() -> None:
    backend = _Runtime("hip", {})
    err = registration_error(backend, 2, "chunk 0", "", " Raise RLIMIT_MEMLOCK.")
    assert isinstance(err, errors.MemlockLimitError) and "(hipErrorOutOfMemory, error 2)" in str(err)
    err = registration_error(backend, 2, "chunk 0", "", "")  # no memlock reason: a plain registration error
    assert type(err) is errors.RegistrationError and "hipErrorOutOfMemory" in str(err)
    # the emulated backend names the limit itself; its out-of-memory is never read as the limit
    emu = backend_for(DEV)
    assert isinstance(registration_error(emu, MEMLOCK_EXCEEDED, "chunk 0", "", ""), errors.MemlockLimitError)
    assert type(registration_error(emu, 2, "chunk 0", "", " hint")) is errors.RegistrationError


def test_a_failed_call_names_the_runtime_code() -> None:
    with pytest.raises(errors.RuntimeCallError) as info:
        check(_Runtime("hip", {}), "copy runs", 1052)
    assert info.value.code == 1052 and "hipErrorRuntimeMemory: text of 1052" in str(info.value)
    with pytest.raises(errors.RuntimeCallError) as info:
        check(_Runtime("cuda", {}), "copy runs", 700)
    assert "cudaErrorIllegalAddress" in str(info.value)
    check(_Runtime("hip", {}), "copy runs", 0)  # success raises nothing


def test_a_faulted_launch_on_a_hip_backend_reads_as_hip() -> None:
    layout = pd.KVLayout(kind="layer_first", num_layers=1, num_pages=2, page_size=4, num_heads=1, head_dim=8,
                         dtype="float32")
    src, dst = pd.DeviceKVPool(layout, DEV), pd.DeviceKVPool(layout, DEV)
    idx = torch.arange(4)
    with install_backend(_Runtime("hip", {"launch": {1: 719}}), "emulated"):
        with pytest.raises(errors.RuntimeCallError) as info:
            pd.transfer_kv_all_layer(src.table, dst.table, idx, idx + 4, src_layout=layout, dst_layout=layout,
                                     backend="kernel")
    assert info.value.code == 719 and "hipErrorLaunchFailure" in str(info.value)
