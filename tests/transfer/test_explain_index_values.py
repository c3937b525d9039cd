"""explain_transfer refuses what the transfer refuses before its launch for indices the
host reads (slot range, a destination slot twice, a slot read and written in one memory),
with the same error class and message, and explains a valid call as the launch runs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.testing import DelegatingBackend, backend_for, install_backend

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


# -- explain's verdict is the launch's, over a matrix of bad (and good) calls -------------------

_CASES = {  # (src slots, dst slots) on the device pool's side / the host pool's side
    "valid": ([0, 1, 5], [2, 3, 7]),
    "src out of range": ([0, 10**6], [2, 3]),
    "dst out of range": ([0, 1], [2, 10**6]),
    "negative": ([-1, 1], [2, 3]),
    "dst twice": ([0, 1, 2], [3, 4, 3]),
    "dst twice and out of range": ([0, 1, 10**6], [3, 3, 4]),
    "read and written": ([0, 1], [1, 2]),
    "none": ([], []),
}


def _verdict(call: object) -> tuple[str, str] | None:
    try:
        call()  # type: ignore[operator]
    except errors.PointerDomainError as exc:
        return type(exc).__name__, str(exc)
    return None


def _bytes(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in ts])


@pytest.mark.strict_alias  # also run in strict alias mode by CI
@pytest.mark.parametrize("backend", ["auto", "kernel", "copy_engine", "staged"])
@pytest.mark.parametrize("host_kind", ["page_first", "page_head", "layer_first"])
def test_explain_gives_the_launch_verdict(backend: str, host_kind: str) -> None:
    """Every combination of direction (D2H, H2D, inside one device pool), ``validate_indices``,
    index memory (CPU tensors, emulated device memory), all layers or one, and slot sets:
    explain_transfer raises exactly what the launch raises (class and message), or both
    pass; a refused launch leaves the destination as it was."""
    gp = pd.DeviceKVPool(LAYOUT, DEV)
    hp = pd.HostKVPool(LAYOUT.replace(kind=host_kind, num_pages=10), DEV)
    try:
        for t in gp.buffers:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
        checked = 0
        for name, (dev_slots, host_slots) in _CASES.items():
            for direction in ("d2h", "h2d", "inside"):
                if direction == "d2h":
                    src, dst, s_lay, d_lay, s, d, written = gp.table, hp.kernel_table, LAYOUT, hp.layout, \
                        dev_slots, host_slots, (hp.buffer,)
                elif direction == "h2d":
                    src, dst, s_lay, d_lay, s, d, written = hp.kernel_table, gp.table, hp.layout, LAYOUT, \
                        host_slots, dev_slots, tuple(gp.buffers)
                else:
                    src, dst, s_lay, d_lay, s, d, written = gp.table, gp.table, LAYOUT, LAYOUT, dev_slots, \
                        host_slots, tuple(gp.buffers)
                for where in ("cpu", "device"):
                    si, di = torch.tensor(s, dtype=torch.int64), torch.tensor(d, dtype=torch.int64)
                    if where == "device":
                        si = pd.device_empty(si.shape, torch.int64, DEV).copy_(si)
                        di = pd.device_empty(di.shape, torch.int64, DEV).copy_(di)
                    for validate in (True, "host", False):
                        for layer in (None, 1):
                            kw = dict(src_layout=s_lay, dst_layout=d_lay, backend=backend, validate_indices=validate)
                            explained = _verdict(lambda: pd.explain_transfer(src, dst, si, di, layer_id=layer, **kw))
                            before = _bytes(*written)
                            if layer is None:
                                launched = _verdict(lambda: pd.transfer_kv_all_layer(src, dst, si, di, **kw))
                            else:
                                launched = _verdict(lambda: pd.transfer_kv_per_layer(src, dst, si, di, layer_id=layer,
                                                                                     **kw))
                            where_ = (name, direction, where, validate, layer)
                            assert explained == launched, where_
                            if launched is not None:
                                assert torch.equal(_bytes(*written), before), where_
                            checked += 1
        assert checked == len(_CASES) * 3 * 2 * 3 * 2
    finally:
        hp.close()


class _UnreadableDevice(DelegatingBackend):
    """The emulated device as a GPU's memory looks to the host: not readable in place, so a
    launch reads device-memory indices on the host only where its path copies them there."""

    def __init__(self) -> None:
        super().__init__(backend_for(DEV), "unreadable")
        self.host_readable = False


@pytest.mark.strict_alias  # also run in strict alias mode by CI
@pytest.mark.parametrize("backend", ["copy_engine", "kernel"])
def test_explain_reads_device_indices_where_the_launch_does(backend: str) -> None:
    """Indices in device memory the host cannot read in place: the copy engine and
    ``validate_indices="host"`` read them on the host before launching (a device sync on
    CUDA) and refuse a bad slot; explain_transfer gives the same verdict."""
    with install_backend(_UnreadableDevice(), "emulated"):
        gp = pd.DeviceKVPool(LAYOUT, DEV)
        hp = pd.HostKVPool(LAYOUT.replace(kind="page_first", num_pages=10), DEV)
        try:
            seen = set()
            for name, (dev_slots, host_slots) in _CASES.items():
                si = pd.device_empty((len(dev_slots),), torch.int64, DEV).copy_(torch.tensor(dev_slots, dtype=torch.int64))
                di = pd.device_empty((len(host_slots),), torch.int64, DEV).copy_(torch.tensor(host_slots, dtype=torch.int64))
                # (validate_indices=True on the kernel path would leave errors in the device's error word)
                for validate in (("host", False) if backend == "kernel" else (True, "host", False)):
                    kw = dict(src_layout=LAYOUT, dst_layout=hp.layout, backend=backend, validate_indices=validate)
                    explained = _verdict(lambda: pd.explain_transfer(gp.table, hp.kernel_table, si, di, **kw))
                    before = _bytes(hp.buffer)
                    launched = _verdict(lambda: pd.transfer_kv_all_layer(gp.table, hp.kernel_table, si, di, **kw))
                    assert explained == launched, (name, validate)
                    if launched is not None:
                        assert torch.equal(_bytes(hp.buffer), before), (name, validate)
                    seen.add(None if launched is None else launched[0])
            assert "IndexValidationError" in seen and None in seen
        finally:
            hp.close()
