"""Launch functions accept only PointerTable[DeviceAlias]: a host table, an
address, an int or a raw tensor in either table position is a static error."""

from __future__ import annotations

import torch

from pointerdomain import (
    DeviceAlias,
    DeviceKVPool,
    HostKVPool,
    HostVA,
    KVLayout,
    PointerTable,
    RegisteredHostMemory,
    load_layers,
    make_kernel_ptr_table,
    transfer_kv_all_layer,
    transfer_kv_per_layer,
)


def launches(
    kernel: PointerTable[DeviceAlias],
    host: PointerTable[HostVA],
    either: PointerTable[HostVA] | PointerTable[DeviceAlias],
    layout: KVLayout,
    idx: torch.Tensor,
) -> None:
    # transfer_kv_all_layer: a host table as src, as dst, as both.
    transfer_kv_all_layer(host, kernel, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    transfer_kv_all_layer(kernel, host, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    transfer_kv_all_layer(host, host, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    # transfer_kv_per_layer: the same.
    transfer_kv_per_layer(host, kernel, idx, idx, layer_id=0, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    transfer_kv_per_layer(kernel, host, idx, idx, layer_id=0, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    transfer_kv_per_layer(host, host, idx, idx, layer_id=0, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    # load_layers (the layer pipeline): the same.
    load_layers(host, kernel, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    load_layers(kernel, host, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    # A LayerLoad's layer is an int, its stream an int or None.
    done = load_layers(kernel, kernel, idx, idx, src_layout=layout, dst_layout=layout)
    done.wait("0")  # type: ignore[arg-type]
    done.wait(0, stream="s")  # type: ignore[arg-type]
    # A table of unknown domain must be narrowed first (there is no isinstance for a type argument).
    transfer_kv_all_layer(either, kernel, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    # Not a table at all: one address, a raw int, the table's escape-hatch tensor.
    transfer_kv_all_layer(kernel[0], kernel, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    transfer_kv_all_layer(kernel, host[0].value, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    transfer_kv_per_layer(kernel.as_uint64_tensor(), kernel, idx, idx, layer_id=0, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    # Indices are tensors, not tables or addresses.
    transfer_kv_all_layer(kernel, kernel, host, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    # The layouts are keyword-only, and layer_id is required per layer.
    transfer_kv_all_layer(kernel, kernel, idx, idx, layout, layout)  # type: ignore[call-arg]
    transfer_kv_per_layer(kernel, kernel, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[call-arg]
    # Launch options: a backend outside the Literal, a stream that is not an int, a non-bool flag.
    transfer_kv_all_layer(kernel, kernel, idx, idx, src_layout=layout, dst_layout=layout, backend="cuda")  # type: ignore[arg-type]
    transfer_kv_all_layer(kernel, kernel, idx, idx, src_layout=layout, dst_layout=layout, stream="0")  # type: ignore[arg-type]
    transfer_kv_all_layer(kernel, kernel, idx, idx, src_layout=layout, dst_layout=layout, validate_indices="no")  # type: ignore[arg-type]


def pools(device_pool: DeviceKVPool, host_pool: HostKVPool, idx: torch.Tensor) -> None:
    layout = host_pool.layout
    # A host pool's host table is for metadata, never for a launch.
    transfer_kv_all_layer(device_pool.table, host_pool.host_table, idx, idx, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    transfer_kv_per_layer(host_pool.host_table, device_pool.table, idx, idx, layer_id=0, src_layout=layout, dst_layout=layout)  # type: ignore[arg-type]
    # Its attributes keep their domain on assignment.
    host_pool.kernel_table = host_pool.host_table  # type: ignore[assignment]
    device_pool.table = host_pool.host_table  # type: ignore[assignment]
    # The pool methods take a device pool and index tensors, not tables.
    host_pool.backup(device_pool.table, idx, idx)  # type: ignore[arg-type]
    host_pool.load(device_pool, host_pool.host_table, idx)  # type: ignore[arg-type]
    host_pool.load_layer(device_pool, idx, idx, layer_id=HostVA.unsafe_from_int(0))  # type: ignore[arg-type]
    # The boundary checks take no device: a table knows its own.
    host_pool.kernel_table.check_kernel_readable(host_pool.device)  # type: ignore[call-arg]


def device_parameters(memory: RegisteredHostMemory, va: HostVA) -> None:
    # device parameters take Device | str | torch.device: an address is not a device.
    make_kernel_ptr_table([memory.tensor], va)  # type: ignore[arg-type]
