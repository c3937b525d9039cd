"""Tables and descriptors for a cache's own kernels and for NIXL: a host-VA table or a raw
tensor into a kernel argument, a device alias or a raw int into a DRAM descriptor, are
static errors (and DomainError at run time, see tests/test_kernel_args.py and
tests/test_nixl.py)."""

from __future__ import annotations

import torch

from pointerdomain import BufferInfo, DeviceAlias, HostKVPool, HostVA, PointerTable
from pointerdomain.adapters.nixl import HostNixlAgent, dram_desc, vram_desc
from pointerdomain.transfer.kernel_args import kernel_table_tensor
from pointerdomain.transfer.triton import kernel_table_arg


def kernels(kernel: PointerTable[DeviceAlias], host: PointerTable[HostVA], raw: torch.Tensor) -> None:
    kernel_table_tensor(host, "emulated:0")  # type: ignore[arg-type]
    kernel_table_arg(host, "cuda:0")  # type: ignore[arg-type]
    kernel_table_arg(raw, "cuda:0")  # type: ignore[arg-type]
    kernel_table_arg(kernel[0], "cuda:0")  # type: ignore[arg-type]
    kernel_table_tensor(kernel, "cuda:0", dtype="int32")  # type: ignore[arg-type]


def nixl(pool: HostKVPool, agent: HostNixlAgent, alias: DeviceAlias, info: BufferInfo) -> None:
    dram_desc(alias, 64)  # type: ignore[arg-type]
    dram_desc(pool.kernel_table[0], 64)  # type: ignore[arg-type]
    dram_desc(info.address.value, 64)  # type: ignore[arg-type]
    dram_desc(pool.buffer)  # type: ignore[arg-type]
    vram_desc(alias, "cuda:0")  # type: ignore[arg-type]
    agent.read("peer", [alias], [info])  # type: ignore[list-item]
    agent.transfer("COPY", [dram_desc(info)], [dram_desc(info)], "peer")  # type: ignore[arg-type]
    agent.register([info])  # type: ignore[list-item]
