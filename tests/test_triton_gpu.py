"""A Triton kernel that loads pointers from kernel tables moves KV pages from a registered
host pool into a device pool (GPU only: run on the H200 by the coordinator).

The kernel reads the host pool only through its ``PointerTable[DeviceAlias]`` (the
alias of the registration, from ``cudaHostGetDevicePointer``) and writes the device
pool through its table; :func:`pointerdomain.transfer.triton.launch` checks both tables
(domain, device, open registration) before the launch. The moved bytes are compared
with plain torch indexing on the host side, and every slot not addressed must keep its
poison. Skipped without triton or without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors

triton = pytest.importorskip("triton", reason="triton is not installed (it is on the GPU machine)")

from pointerdomain.transfer.triton import kernel_table_arg, launch  # noqa: E402
from tests.triton_pages import load_pages as _load_pages  # noqa: E402

pytestmark = pytest.mark.gpu


def _slots(pages: list[int], page_size: int, device: str) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(device)


@pytest.fixture
def cuda_device() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "cuda:0"


def test_triton_kernel_moves_pages_through_the_tables(cuda_device: str) -> None:
    dev_layout = pd.KVLayout(kind="layer_first", num_layers=4, num_pages=16, page_size=8, num_heads=8, head_dim=128,
                             dtype="bfloat16")
    host_layout = dev_layout.model_copy(update={"kind": "page_first", "num_pages": 12})
    item = host_layout.item_bytes
    device_pool = pd.DeviceKVPool(dev_layout, cuda_device)
    for t in device_pool.buffers:
        t.view(torch.uint8).fill_(0xA5)                                   # poison
    with pd.HostKVPool(host_layout, cuda_device) as host_pool:
        assert len(host_pool.kernel_table) == 1                           # one registration chunk
        flat = host_pool.buffer.view(torch.uint8).view(-1)
        g = torch.Generator().manual_seed(7)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
        host_pages, dev_pages = [9, 2, 5, 11], [3, 14, 0, 7]
        hs = _slots(host_pages, host_layout.page_size, cuda_device)
        ds = _slots(dev_pages, dev_layout.page_size, cuda_device)
        grid = (hs.numel(), dev_layout.num_kv * dev_layout.num_layers)
        launch(_load_pages, grid, host_pool.kernel_table, device_pool.table, hs, ds, device=cuda_device,
               NUM_LAYERS=dev_layout.num_layers, HOST_SLOTS=host_layout.num_slots, ITEM_BYTES=item,
               BLOCK=min(1024, triton.next_power_of_2(item)))
        torch.cuda.synchronize()
        hs_cpu, ds_cpu = hs.cpu(), ds.cpu()
        for kv in range(dev_layout.num_kv):
            for layer in range(dev_layout.num_layers):
                got = device_pool.buffer(kv, layer).view(torch.uint8).cpu()
                expect = torch.full_like(got, 0xA5)
                expect[ds_cpu] = host_pool.buffer[kv][hs_cpu, layer].contiguous().view(torch.uint8)
                assert torch.equal(got, expect), (kv, layer)

        # refused before any launch: a host-VA table, a raw uint64 tensor, a bare alias
        before = [t.clone() for t in device_pool.buffers]
        for bad in (host_pool.host_table, host_pool.kernel_table.as_uint64_tensor(), host_pool.kernel_table[0]):
            with pytest.raises(errors.DomainError):
                launch(_load_pages, grid, bad, device_pool.table, hs, ds, device=cuda_device,
                       NUM_LAYERS=dev_layout.num_layers, HOST_SLOTS=host_layout.num_slots, ITEM_BYTES=item, BLOCK=256)
        assert kernel_table_arg(host_pool.kernel_table, cuda_device).tolist() == [host_pool.kernel_table[0].value]
    with pytest.raises(errors.ClosedError):                               # the pool is closed now
        launch(_load_pages, grid, host_pool.kernel_table, device_pool.table, hs, ds, device=cuda_device,
               NUM_LAYERS=dev_layout.num_layers, HOST_SLOTS=host_layout.num_slots, ITEM_BYTES=item, BLOCK=256)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(device_pool.buffers, before))  # bytes: random data holds NaNs
