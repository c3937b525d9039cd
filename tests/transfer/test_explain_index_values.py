"""explain_transfer refuses what the transfer refuses before its launch for indices the
host reads (slot range, a destination slot twice, a slot read and written in one memory),
with the same error class and message, and explains a valid call as the launch runs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors

DEV = pd.Device("emulated", 0)
LAYOUT = pd.KVLayout(kind="layer_first", num_layers=3, num_pages=8, page_size=4, num_heads=2, head_dim=16)


@pytest.fixture
def pools() -> Iterator[tuple[pd.DeviceKVPool, pd.HostKVPool]]:
    gp = pd.DeviceKVPool(LAYOUT, DEV)
    hp = pd.HostKVPool(LAYOUT.replace(kind="page_first", num_pages=10), DEV)
    yield gp, hp
    hp.close()


def _u8(pool: pd.DeviceKVPool) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in pool.buffers])


@pytest.mark.parametrize("validate", [True, "host"])
@pytest.mark.parametrize(("s", "d", "error"), [
    ([1, 2], [5, 5], errors.OverlapError),
    ([1], [99], errors.IndexValidationError),
    ([-1], [3], errors.IndexValidationError),
])
def test_explain_raises_what_the_transfer_raises(
        pools: tuple[pd.DeviceKVPool, pd.HostKVPool], validate: bool | str, s: list[int], d: list[int],
        error: type[Exception]) -> None:
    gp, hp = pools
    kw = dict(src_layout=hp.layout, dst_layout=gp.layout, validate_indices=validate)
    si, di = torch.tensor(s), torch.tensor(d)
    with pytest.raises(error) as explained:
        pd.explain_transfer(hp.kernel_table, gp.table, si, di, **kw)  # type: ignore[arg-type]
    for t in gp.buffers:
        t.view(torch.uint8).fill_(0xA5)
    before = _u8(gp).clone()
    with pytest.raises(error) as launched:
        pd.transfer_kv_all_layer(hp.kernel_table, gp.table, si, di, **kw)  # type: ignore[arg-type]
    assert str(explained.value) == str(launched.value)
    assert torch.equal(_u8(gp), before)


def test_explain_refuses_a_slot_read_and_written_in_one_pool(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    gp, _ = pools
    kw = dict(src_layout=gp.layout, dst_layout=gp.layout)
    si, di = torch.tensor([1, 2]), torch.tensor([2, 3])
    with pytest.raises(errors.OverlapError) as explained:
        pd.explain_transfer(gp.table, gp.table, si, di, **kw)  # type: ignore[arg-type]
    with pytest.raises(errors.OverlapError) as launched:
        pd.transfer_kv_all_layer(gp.table, gp.table, si, di, **kw)  # type: ignore[arg-type]
    assert str(explained.value) == str(launched.value)


def test_unchecked_indices_explain_as_the_launch_runs(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    gp, hp = pools  # validate_indices=False: the launch checks no values, nor does explain
    kw = dict(src_layout=hp.layout, dst_layout=gp.layout, validate_indices=False)
    choice = pd.explain_transfer(hp.kernel_table, gp.table, torch.tensor([1]), torch.tensor([99]), **kw)  # type: ignore[arg-type]
    assert choice.path == "kernel"


@pytest.mark.parametrize("validate", [True, "host"])
def test_valid_call_explains_and_copies(pools: tuple[pd.DeviceKVPool, pd.HostKVPool], validate: bool | str) -> None:
    gp, hp = pools
    kw = dict(src_layout=hp.layout, dst_layout=gp.layout, validate_indices=validate)
    si, di = torch.tensor([1, 2, 39]), torch.tensor([5, 6, 0])
    host = hp.buffer.view(torch.uint8)  # [kv, slot, layer, heads, dim * 2]
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    for t in gp.buffers:
        t.view(torch.uint8).fill_(0xA5)
    choice = pd.explain_transfer(hp.kernel_table, gp.table, si, di, **kw)  # type: ignore[arg-type]
    assert choice.path == "kernel" and choice.host_indices
    pd.transfer_kv_all_layer(hp.kernel_table, gp.table, si, di, **kw)  # type: ignore[arg-type]
    for kv in range(2):
        for layer in range(LAYOUT.num_layers):
            got = gp.buffer(kv, layer).view(torch.uint8)  # [slot, heads, dim * 2]
            want = torch.full_like(got, 0xA5)
            want[di] = host[kv, si, layer]
            assert torch.equal(got, want)
