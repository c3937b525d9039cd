"""The platform seam (pointerdomain._platform), the launch plan (pointerdomain.transfer.plan),
devices and the layout helpers the adapters use, on the emulated backend.

Faults are injected through the documented hook (``_platform.testing.install_backend``
with a ``FaultyBackend``), never by patching private functions."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import checked, errors
from pointerdomain._platform import LaunchArgs, backend_for
from pointerdomain._platform.faulty import FaultyBackend
from pointerdomain._platform.testing import install_backend
from pointerdomain.transfer.plan import TransferPlan, plan_for
from tests.reference import EMU, fill_pool, fill_random, reference_transfer

DEV = pd.Device("emulated", 0)
DEV_LAYOUT = pd.KVLayout(kind="layer_first", num_layers=3, num_pages=6, page_size=4, num_heads=2, head_dim=16)
HOST_LAYOUT = DEV_LAYOUT.model_copy(update={"kind": "page_first", "num_pages": 9})


@pytest.fixture
def pools() -> Iterator[tuple[pd.DeviceKVPool, pd.HostKVPool]]:
    dev = pd.DeviceKVPool(DEV_LAYOUT, DEV)
    fill_pool(dev, 1)
    with pd.HostKVPool(HOST_LAYOUT, DEV) as host:
        fill_random(host.buffer, 2)
        yield dev, host


def one_buffer(pool: pd.DeviceKVPool) -> torch.Tensor:
    """A device pool's per-layer buffers as the layer_first one-buffer bytes (K layers, then V)."""
    return torch.cat([b.reshape(-1).view(torch.uint8) for b in pool.buffers])


# ------------------------------------------------------------------ the hook


def test_backend_for_picks_one_backend_per_device_type() -> None:
    assert backend_for(DEV) is backend_for(pd.Device("emulated", 1)) is EMU
    assert EMU.runtime == "emulated" and EMU.host_readable and EMU.has_alias_op


def test_install_backend_restores_the_previous_backend_even_on_error() -> None:
    faulty = FaultyBackend(EMU, fail={})
    with pytest.raises(RuntimeError, match="inside"):
        with install_backend(faulty, "emulated"):
            assert backend_for(DEV) is faulty
            raise RuntimeError("inside")
    assert backend_for(DEV) is EMU


def test_failed_launch_raises_the_typed_error_and_copies_nothing(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    dev, host = pools
    before = host.buffer.view(torch.uint8).reshape(-1).clone()
    slots = torch.tensor([0, 5, 9])
    assert plan_for(dev.table, DEV_LAYOUT, host.kernel_table, HOST_LAYOUT).platform is EMU
    with install_backend(FaultyBackend(EMU, fail={"launch": {1: 700}}), "emulated") as faulty:
        assert plan_for(dev.table, DEV_LAYOUT, host.kernel_table, HOST_LAYOUT).platform is faulty  # plans rebuilt
        with pytest.raises(errors.RuntimeCallError) as info:
            host.backup(dev, slots, slots, backend="kernel")
        assert info.value.code == 700 and "transfer kernel launch" in str(info.value)
        assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), before)
        host.backup(dev, slots, slots, backend="kernel")  # the second launch goes through
        assert faulty.calls["launch"] == 2
    assert plan_for(dev.table, DEV_LAYOUT, host.kernel_table, HOST_LAYOUT).platform is EMU  # rebuilt again after
    expected = reference_transfer(one_buffer(dev), DEV_LAYOUT, before, HOST_LAYOUT, slots, slots)
    assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)


def test_failed_copy_engine_run_raises_the_typed_error(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    dev, host = pools
    before = host.buffer.view(torch.uint8).reshape(-1).clone()
    with install_backend(FaultyBackend(EMU, fail={"copy_runs": {1: 1}}), "emulated") as faulty:
        with pytest.raises(errors.RuntimeCallError, match="copy runs failed with error 1"):
            host.backup(dev, torch.tensor([3]), torch.tensor([4]), backend="copy_engine")
    assert faulty.calls == {"register": 0, "unregister": 0, "launch": 0, "copy_runs": 1,
                            "staged": 0}
    assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), before)


@pytest.mark.slow
def test_extension_missing_is_reported_on_first_use() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["pointerdomain._C"] = None  # the extension fails to import
        import pointerdomain as pd
        from pointerdomain import errors
        try:
            pd.alloc_registered(4096, "emulated:0")
        except errors.ExtensionUnavailableError as exc:
            assert isinstance(exc, ImportError) and "pip install" in str(exc), exc
            print("refused")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr


# ------------------------------------------------------------------ the plan


def test_plan_carries_the_bound_struct_the_kernels_read(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    dev, host = pools
    plan = plan_for(dev.table, DEV_LAYOUT, host.kernel_table, HOST_LAYOUT)
    assert isinstance(plan, TransferPlan) and plan is plan_for(dev.table, DEV_LAYOUT, host.kernel_table, HOST_LAYOUT)
    assert plan.src_geometry == DEV_LAYOUT.geometry(len(dev.table), dev.table.sizes, "src")
    kernel = plan.kernel
    assert (kernel.src_table, kernel.dst_table) == (dev.table.kernel_table_address(), host.kernel_table.kernel_table_address())
    assert tuple(kernel.src_geometry) == plan.src_geometry and tuple(kernel.dst_geometry) == plan.dst_geometry
    assert (kernel.page_size, kernel.num_kv, kernel.item_bytes, kernel.vec_bytes) == (4, 2, 64, 16)
    assert plan.src_geometry.s_tok == DEV_LAYOUT.item_bytes and plan.dst_geometry.s_tok == 3 * DEV_LAYOUT.item_bytes
    assert plan.run_bytes == DEV_LAYOUT.item_bytes  # page_first interleaves layers per token: runs of one item


def test_checked_mode_refuses_a_plan_of_other_tables(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    dev, host = pools
    other = pd.DeviceKVPool(DEV_LAYOUT, DEV)
    plan = plan_for(other.table, DEV_LAYOUT, host.kernel_table, HOST_LAYOUT)
    slots = torch.tensor([1])
    args = LaunchArgs(slots.data_ptr(), slots.data_ptr(), 1, 0, 3, DEV, 0, 2)
    with checked.checked_mode(True), pytest.raises(errors.DomainError, match="plan's src table is not this src table"):
        checked.verify_launch(plan, dev.table, host.kernel_table, slots, slots, args)


@pytest.mark.parametrize("wrong", ["indices", "count", "layers", "device"])
def test_checked_mode_refuses_launch_arguments_that_are_not_the_checked_call(
    pools: tuple[pd.DeviceKVPool, pd.HostKVPool], wrong: str
) -> None:
    """Checked mode verifies what the backend receives: the bound LaunchArgs must name the
    checked index tensors, their count, layers of the layouts and the plan's device."""
    dev, host = pools
    plan = plan_for(dev.table, DEV_LAYOUT, host.kernel_table, HOST_LAYOUT)
    slots, other = torch.tensor([1, 2]), torch.tensor([1, 2])
    good = LaunchArgs(slots.data_ptr(), slots.data_ptr(), 2, 0, 3, DEV, 0, 2)
    checked.verify_launch(plan, dev.table, host.kernel_table, slots, slots, good)  # the call itself passes
    bad, error = {
        "indices": (good._replace(dst_idx=other.data_ptr()), errors.IndexValidationError),
        "count": (good._replace(n=3), errors.IndexValidationError),
        "layers": (good._replace(layer_begin=1), errors.LayoutError),
        "device": (good._replace(device=pd.Device("emulated", 1)), errors.DeviceMismatchError),
    }[wrong]
    with pytest.raises(error, match="checked mode"):
        checked.verify_launch(plan, dev.table, host.kernel_table, slots, slots, bad)


# ------------------------------------------------------------------ SM budget


def test_whole_gpu_is_the_explicit_sentinel(pools: tuple[pd.DeviceKVPool, pd.HostKVPool]) -> None:
    dev, host = pools
    before = host.buffer.view(torch.uint8).reshape(-1).clone()
    slots = torch.tensor([2, 7])
    host.backup(dev, slots, slots, max_ctas=pd.WHOLE_GPU)
    expected = reference_transfer(one_buffer(dev), DEV_LAYOUT, before, HOST_LAYOUT, slots, slots)
    assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
    for bad in (None, 0, -1, 2.0, "whole"):
        with pytest.raises(errors.InvalidArgumentError, match="WHOLE_GPU"):
            pd.transfer_kv_all_layer(dev.table, host.kernel_table, slots, slots, src_layout=DEV_LAYOUT,
                                     dst_layout=HOST_LAYOUT, max_ctas=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ devices


def test_tensor_on_and_external_stream() -> None:
    from pointerdomain.devices import tensor_on

    assert tensor_on(torch.zeros(1), DEV) and not tensor_on(torch.zeros(1, device="meta"), DEV)
    assert pd.external_stream(DEV, 123) is None and pd.external_stream(DEV, None) is None


# ------------------------------------------------------------------ layout helpers


@pytest.mark.parametrize("kind", ["layer_first", "page_first", "page_first_direct"])
def test_page_blocks_in_both_orders_cover_exactly_the_page(kind: str) -> None:
    lay = DEV_LAYOUT.model_copy(update={"kind": kind})
    flat = torch.arange(lay.nbytes // 4, dtype=torch.int32).view(torch.uint8)
    from tests.reference import canonical

    page = 4
    want = canonical(flat, lay)[:, :, page].reshape(-1).sort().values
    for order in ("kv_major", "layer_major"):
        for merge in (True, False):
            blocks = lay.page_blocks(page, order=order, merge=merge)
            got = torch.cat([flat[off : off + n] for off, n in blocks]).sort().values
            assert torch.equal(got, want), (order, merge)
    per_layer = lay.page_blocks(page, order="layer_major", merge=False)
    if kind == "layer_first":  # sglang's order: K(l0), V(l0), K(l1), ...
        assert len(per_layer) == 2 * lay.num_layers and per_layer[1][0] > per_layer[2][0]
    regions = lay.page_regions()
    assert sum(n for _, n in regions) == lay.nbytes and all(n == lay.num_pages * lay.page_block_bytes() for _, n in regions)
    views = lay.page_block_views(flat)
    assert len(views) == lay.split_for_page_blocks() and torch.equal(torch.cat(views), flat)


def test_one_dtype_table() -> None:
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"):
        lay = DEV_LAYOUT.model_copy(update={"dtype": name})
        assert pd.KVLayout.dtype_name(lay.torch_dtype) == name
        assert lay.item_bytes == 2 * 16 * torch.empty((), dtype=lay.torch_dtype).element_size()
    with pytest.raises(errors.LayoutError, match="not a KV dtype"):
        pd.KVLayout.dtype_name(torch.complex64)
