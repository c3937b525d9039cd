"""Registration (pointerdomain.registration.memory) and alias resolution (pointerdomain.registration.resolve) on the emulated backend."""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from tests.reference import DEV

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias


def test_emulated_alias_differs_and_sees_host_writes() -> None:
    with pd.alloc_registered(1 << 16, DEV) as mem:
        alias = pd.resolve_alias(mem.host_va + 100, DEV)
        assert alias.value != (mem.host_va + 100).value
        assert alias - pd.resolve_alias(mem.host_va, DEV) == 100  # interior pointer keeps its offset
        mem.tensor[100:108] = torch.arange(8, dtype=torch.uint8) + 1
        import ctypes
        assert ctypes.string_at(alias.value, 8) == bytes(range(1, 9))


def test_double_registration_raises_and_next_works() -> None:
    t = torch.empty(1 << 16, dtype=torch.uint8)
    with pd.register_host_tensor(t, DEV) as mem:
        with pytest.raises(errors.AlreadyRegisteredError):
            pd.register_host_tensor(t[4096:8192], DEV)
        assert not mem.closed
    with pd.register_host_tensor(t, DEV) as again:
        assert pd.resolve_alias(again.host_va, DEV).value != again.host_va.value


def test_register_existing_tensor_keeps_bytes_and_aliases() -> None:
    t = torch.arange(1 << 14, dtype=torch.int32)
    before = t.clone()
    with pd.register_host_tensor(t, DEV) as mem:
        assert torch.equal(t, before)
        import ctypes
        alias = pd.resolve_alias(mem.host_va + 40, DEV)
        assert ctypes.string_at(alias.value, 4) == ctypes.string_at(before.data_ptr() + 40, 4)
        t[10] = 7
        assert int.from_bytes(ctypes.string_at(alias.value, 4), "little") == 7


def test_registration_rules() -> None:
    with pytest.raises(ValueError):
        pd.alloc_registered(0, DEV)
    with pytest.raises(errors.NonContiguousError):
        pd.register_host_tensor(torch.empty(64, 64)[:, :8], DEV)
    with pytest.raises(errors.InvalidDeviceError):
        pd.alloc_registered(4096, "emulated:9")


def test_chunked_registration_cuts_on_granularity() -> None:
    with pd.alloc_registered(10 * 4096, DEV, granularity=4096, max_chunk_bytes=3 * 4096 + 5) as mem:
        assert [c.nbytes for c in mem.chunks] == [3 * 4096, 3 * 4096, 3 * 4096, 4096]
        a0 = pd.resolve_alias(mem.host_va + 3 * 4096 - 1, DEV)
        a1 = pd.resolve_alias(mem.host_va + 3 * 4096, DEV)
        assert a1.value != a0.value + 1  # separate registrations are not contiguous in alias space
        with pytest.raises(errors.RegistrationSpanError):
            pd.make_kernel_ptr_table([mem.tensor[4096 : 5 * 4096]], DEV)


def test_close_is_idempotent_and_blocks_use() -> None:
    mem = pd.alloc_registered(4096, DEV)
    table = pd.make_kernel_ptr_table([mem.tensor], DEV)
    mem.close()
    mem.close()
    with pytest.raises(errors.ClosedError):
        table.check_live()
    with pytest.raises(errors.ClosedError):
        pd.resolve_alias(mem.host_va, DEV)


def test_resolver_policy_and_fallback() -> None:
    from pointerdomain.registration.resolve import decide_policy

    assert pd.alias_policy(DEV) is pd.AliasPolicy.EMULATED
    assert decide_policy("cuda", True, None) is pd.AliasPolicy.RUNTIME_OP
    assert decide_policy("cuda", False, 1) is pd.AliasPolicy.HOST_POINTER_FALLBACK
    for runtime, attr in (("cuda", 0), ("cuda", None), ("hip", 1)):
        with pytest.raises(errors.AliasOpMissingError, match="pip install"):
            decide_policy(runtime, False, attr)
    pd.reset_resolver_cache()
    assert pd.fallback_count() == 0 and pd.alias_policy(DEV) is pd.AliasPolicy.EMULATED


@pytest.mark.parametrize("granularity,max_chunk", [(8192, 4096), (3 * 4096, 2 * 4096), (4096, 4095)])
def test_max_chunk_bytes_below_granularity_is_refused(granularity: int, max_chunk: int) -> None:
    # a chunk is whole granules: a smaller cap could only be exceeded, silently
    with pytest.raises(errors.InvalidRegistrationError, match="below granularity"):
        pd.alloc_registered(4 * granularity, DEV, granularity=granularity, max_chunk_bytes=max_chunk)
    buf = torch.zeros(4 * granularity, dtype=torch.uint8)
    with pytest.raises(errors.InvalidRegistrationError, match="below granularity"):
        pd.register_host_tensor(buf, DEV, granularity=granularity, max_chunk_bytes=max_chunk)
    # exactly one granule: one granule a chunk, every chunk within the cap
    with pd.alloc_registered(4 * granularity, DEV, granularity=granularity, max_chunk_bytes=granularity) as mem:
        assert [c.nbytes for c in mem.chunks] == [granularity] * 4
