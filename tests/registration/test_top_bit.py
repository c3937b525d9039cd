"""Addresses >= 2**63 (XPU USM hands them out) keep all 64 bits through the uint64 tables,
the int64 Triton view, BufferInfo / HostVA JSON and the launch path: the top-bit profile
(pointerdomain.testing.TopBitAliases) gives every alias bit 63 and the bytes that move are
checked against plain torch."""

from __future__ import annotations

import json

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.registration.tables import resolved_kernel_table
from pointerdomain.testing import TOP_BIT, TopBitAliases, backend_for, install_backend
from pointerdomain.transfer.triton import kernel_table_arg
from tests.reference import DEV, fill_pool, fill_random, model_layout, pool_bytes, reference_transfer

#: Also run in strict alias mode by CI (python -m pytest -m strict_alias --strict-alias).
pytestmark = pytest.mark.strict_alias

HIGH = [TOP_BIT, TOP_BIT + 0x1000, (1 << 64) - 4096, (1 << 64) - 1]


def test_metadata_round_trips_every_bit() -> None:
    for value in HIGH:
        va = pd.HostVA.unsafe_from_int(value)
        info = pd.BufferInfo(address=va, nbytes=1, item_bytes=1) if value == (1 << 64) - 1 else \
            pd.BufferInfo(address=va, nbytes=4096, item_bytes=64)
        text = info.model_dump_json()
        assert json.loads(text)["address"] == value  # a JSON integer, not a negative int64
        assert pd.BufferInfo.model_validate_json(text) == info
        with pytest.raises(errors.MetadataValidationError):  # a bare int is no HostVA, high or not
            pd.BufferInfo.model_validate(json.loads(text))
        alias = pd.DeviceAlias.unsafe_from_int(value, pd.as_device(DEV))
        assert alias.value == value and alias != va
    with pytest.raises(errors.PointerDomainError):
        pd.BufferInfo(address=pd.HostVA.unsafe_from_int((1 << 64) - 4096), nbytes=8192, item_bytes=64)  # past 2**64
    with pytest.raises(errors.InvalidArgumentError):
        pd.HostVA.unsafe_from_int(1 << 64)


def test_uint64_table_and_triton_view_keep_bit_63() -> None:
    dev = pd.as_device(DEV)
    table = resolved_kernel_table(HIGH, [1] * len(HIGH), dev, [])
    assert table.as_uint64_tensor().tolist() == HIGH
    assert [a.value for a in table] == HIGH
    arg = kernel_table_arg(table, dev)
    assert arg.dtype == torch.int64 and arg.view(torch.uint64).tolist() == HIGH
    assert int(arg[0]) == -(1 << 63)  # the same bits: Triton casts them back to a pointer


def test_top_bit_aliases_move_exact_bytes() -> None:
    dev_layout = model_layout("layer_first")
    host_layout = model_layout("page_first", pages=16)
    with install_backend(TopBitAliases(backend_for(pd.as_device(DEV))), "emulated") as profile:
        pool = pd.DeviceKVPool(dev_layout, DEV)
        fill_pool(pool, 3)
        with pd.HostKVPool(host_layout, DEV) as host:
            fill_random(host.buffer, 5)
            aliases = [a.value for a in host.kernel_table]
            assert all(a >= TOP_BIT for a in aliases)
            assert host.kernel_table.as_uint64_tensor().tolist() == aliases
            assert all(info.address.value < TOP_BIT for info in host.get_contiguous_buf_infos())  # host VAs
            resolved = pd.resolve_alias(host.memory.host_va + 64, DEV)
            assert resolved.value == aliases[0] + 64 and resolved.value >= TOP_BIT

            src, dst = torch.tensor([0, 7, 13, 31]), torch.tensor([60, 2, 50, 51])
            before = host.buffer.view(torch.uint8).clone()
            expected = reference_transfer(pool_bytes(pool), dev_layout, before, host_layout, src, dst)
            host.backup(pool, src, dst, backend="kernel")
            assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
            assert profile.translated > 0  # the launch got top-bit aliases and translated them

            fill_pool(pool, 11)
            before_dev = pool_bytes(pool)
            expected_dev = reference_transfer(host.buffer, host_layout, before_dev, dev_layout, dst, src)
            host.load(pool, dst, src, backend="kernel")
            assert torch.equal(pool_bytes(pool), expected_dev)
            # the table the kernel read was restored: still the top-bit aliases
            assert host.kernel_table.as_uint64_tensor().tolist() == aliases


@pytest.mark.parametrize("backend", ["copy_engine", "staged"])
def test_top_bit_aliases_move_exact_bytes_on_every_path(backend: str) -> None:
    """The copy engine's runs and the staged path carry the aliases' bit 63 too (int64 sums
    that wrap as uint64's), and move the reference bytes."""
    dev_layout = model_layout("layer_first")
    host_layout = model_layout("page_first", pages=16)
    with install_backend(TopBitAliases(backend_for(pd.as_device(DEV))), "emulated"):
        pool = pd.DeviceKVPool(dev_layout, DEV)
        fill_pool(pool, 4)
        with pd.HostKVPool(host_layout, DEV) as host:
            fill_random(host.buffer, 6)
            src, dst = torch.tensor([1, 8, 9, 30]), torch.tensor([3, 40, 41, 12])
            before = host.buffer.view(torch.uint8).clone()
            expected = reference_transfer(pool_bytes(pool), dev_layout, before, host_layout, src, dst)
            host.backup(pool, src, dst, backend=backend)  # type: ignore[arg-type]
            assert torch.equal(host.buffer.view(torch.uint8).reshape(-1), expected)
            fill_pool(pool, 12)
            expected_dev = reference_transfer(host.buffer, host_layout, pool_bytes(pool), dev_layout, dst, src)
            host.load(pool, dst, src, backend=backend)  # type: ignore[arg-type]
            assert torch.equal(pool_bytes(pool), expected_dev)


def test_raw_tables_of_top_bit_aliases_resolve_and_copy() -> None:
    """vLLM's swap_blocks_batch takes raw data_ptr() addresses: a host address resolves to
    its top-bit alias (the offset added mod 2**64) and the bytes move."""
    from pointerdomain.compat import vllm

    with install_backend(TopBitAliases(backend_for(pd.as_device(DEV))), "emulated"):
        with pd.alloc_registered(4 * 256, DEV) as mem:
            host = mem.tensor.view(4, 256)
            fill_random(host, 8)
            device = pd.device_empty((4, 256), torch.uint8, DEV)
            device.fill_(0xA5)
            src = torch.tensor([host[2].data_ptr(), host[0].data_ptr()], dtype=torch.int64)
            dst = torch.tensor([device[1].data_ptr(), device[3].data_ptr()], dtype=torch.int64)
            vllm.swap_blocks_batch(src, dst, torch.tensor([256, 256], dtype=torch.int64))
            assert torch.equal(device[1], host[2]) and torch.equal(device[3], host[0])
            assert bool((device[0] == 0xA5).all()) and bool((device[2] == 0xA5).all())
            vllm.swap_blocks(host, device, 256, torch.tensor([[3, 0]]))
            assert torch.equal(device[0], host[3])


def test_a_graph_capture_under_the_top_bit_profile_is_refused_not_replayed() -> None:
    """A replay would run the recorded launch with the tables tagged again (bit 63 set),
    which the CPU kernel cannot read: the profile refuses the capture with a typed error."""
    from pointerdomain.testing import EmulatedGraph

    layout = model_layout("layer_first")
    with install_backend(TopBitAliases(backend_for(pd.as_device(DEV))), "emulated"):
        pool = pd.DeviceKVPool(layout, DEV)
        with pd.HostKVPool(model_layout("page_first", pages=16), DEV) as host:
            before = host.buffer.view(torch.uint8).clone()
            graph = EmulatedGraph()
            with pytest.raises(errors.InvalidArgumentError, match="does not capture graphs"):
                with graph.capture(DEV):
                    host.backup(pool, torch.tensor([1, 2]), torch.tensor([4, 5]), backend="kernel")
            graph.replay()  # nothing was recorded
            assert torch.equal(host.buffer.view(torch.uint8), before)
            graph.reset()
