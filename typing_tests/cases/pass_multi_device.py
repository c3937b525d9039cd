"""Multi-device: a host pool's table for another device is still a
``PointerTable[DeviceAlias]`` (a launch takes it), and the emulated device count is an int.
Written as functions: the checks are static (nothing here runs on a GPU)."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from pointerdomain import DeviceAlias, DeviceGuard, DeviceKVPool, HostKVPool, PointerTable, transfer_kv_all_layer
from pointerdomain.devices import Device, emulated_device_count


def per_device(host: HostKVPool, pool1: DeviceKVPool, idx: torch.Tensor) -> None:
    table = host.kernel_table_for("cuda:1")
    assert_type(table, PointerTable[DeviceAlias])
    assert_type(host.kernel_table_for(Device("emulated", 1)), PointerTable[DeviceAlias])
    transfer_kv_all_layer(table, pool1.table, idx, idx, src_layout=host.layout, dst_layout=pool1.layout)
    assert_type(DeviceGuard.for_launch(Device("cuda", 1)), DeviceGuard)
    assert_type(emulated_device_count(), int)
    assert_type(host.memory.alias_devices, tuple[Device, ...])  # the devices its aliases were asked for
    assert_type(host.memory.note_alias_device(Device("cuda", 1)), None)  # what the resolver records
