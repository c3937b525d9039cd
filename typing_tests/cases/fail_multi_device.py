"""Multi-device: a per-device kernel table is no host table (it reaches no
metadata), and ``kernel_table_for`` takes a device, not a table or an alias."""

from __future__ import annotations

from pointerdomain import DeviceAlias, HostKVPool, HostVA, PointerTable, buffer_infos


def per_device(host: HostKVPool, alias: DeviceAlias) -> None:
    buffer_infos(host.kernel_table_for("cuda:1"), 64)  # type: ignore[arg-type]
    wrong: PointerTable[HostVA] = host.kernel_table_for("cuda:1")  # type: ignore[assignment]
    host.kernel_table_for(host.kernel_table)  # type: ignore[arg-type]
    host.kernel_table_for(alias)  # type: ignore[arg-type]
    host.kernel_table_for(1)  # type: ignore[arg-type]
    host.memory.alias_devices = ()  # type: ignore[misc]
    host.memory.note_alias_device("cuda:1")  # type: ignore[arg-type]
    spans: tuple[int, ...] = host.kernel_table.storage_spans()  # type: ignore[assignment]
    del spans
    del wrong
