"""Metadata and host-only functions accept only host VAs and host tables: a
device alias, a kernel table or a plain int is a static error."""

from __future__ import annotations

from pointerdomain import (
    BufferInfo,
    Device,
    DeviceAlias,
    HostKVPool,
    HostVA,
    KVLayout,
    PointerTable,
    RegisteredHostMemory,
    buffer_infos,
    page_buffer_meta,
    resolve_alias,
)
from pointerdomain.registration.memory import Chunk, find_registration


def metadata(kernel: PointerTable[DeviceAlias], host: PointerTable[HostVA], layout: KVLayout, alias: DeviceAlias) -> None:
    # A kernel table to the metadata functions.
    buffer_infos(kernel, 64)  # type: ignore[arg-type]
    page_buffer_meta(kernel, layout, [0])  # type: ignore[arg-type]
    # Not a table: one address, or a raw int.
    buffer_infos(host[0], 64)  # type: ignore[arg-type]
    page_buffer_meta(host[0].value, layout, [0])  # type: ignore[arg-type]
    # An address where a byte count or page number is expected.
    buffer_infos(host, host[0])  # type: ignore[arg-type]
    page_buffer_meta(host, layout, [host[0]])  # type: ignore[list-item]


def fields(alias: DeviceAlias, va: HostVA, info: BufferInfo) -> None:
    # Pydantic fields typed HostVA: a device alias, a plain int, a kernel table entry.
    BufferInfo(address=alias, nbytes=64, item_bytes=64)  # type: ignore[arg-type]
    BufferInfo(address=0x1000, nbytes=64, item_bytes=64)  # type: ignore[arg-type]
    BufferInfo(address=va.value, nbytes=64, item_bytes=64)  # type: ignore[arg-type]
    BufferInfo(address=va, nbytes=va, item_bytes=64)  # type: ignore[arg-type]
    # The field reads back as a HostVA: it is no DeviceAlias and no int.
    wrong: DeviceAlias = info.address  # type: ignore[assignment]
    raw: int = info.address  # type: ignore[assignment]
    # The model is keyword-only (pydantic's __init__).
    BufferInfo(va, 64, 64)  # type: ignore[call-arg]
    del wrong, raw


def host_only(alias: DeviceAlias, device: Device, memory: RegisteredHostMemory, pool: HostKVPool) -> None:
    # Only a host VA resolves to an alias (an alias is already one).
    resolve_alias(alias, device)  # type: ignore[arg-type]
    resolve_alias(0x1000, device)  # type: ignore[arg-type]
    # The registration registry is keyed by host VAs.
    find_registration(alias, 64)  # type: ignore[arg-type]
    memory.contains(alias, 64)  # type: ignore[arg-type]
    memory.chunk_of(alias, 64)  # type: ignore[arg-type]
    Chunk(host_va=alias, nbytes=64)  # type: ignore[arg-type]
    # A host pool's kernel table is for launches, never for metadata.
    buffer_infos(pool.kernel_table, pool.layout.item_bytes)  # type: ignore[arg-type]
    page_buffer_meta(pool.kernel_table, pool.layout, [0])  # type: ignore[arg-type]
    pool.host_table = pool.kernel_table  # type: ignore[assignment]
    pool.get_page_buffer_meta([alias])  # type: ignore[list-item]


def frozen_fields(info: BufferInfo, va: HostVA, layout: KVLayout) -> None:
    # BufferInfo and KVLayout are frozen (class keyword, visible to type checkers).
    info.address = va + 64  # type: ignore[misc]
    layout.num_pages = 4  # type: ignore[misc]
