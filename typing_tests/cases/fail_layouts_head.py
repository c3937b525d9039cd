"""The new layout kinds and head_groups are checked statically: a misspelt kind or a
string count is an error, and a host pool's item address is a HostVA (not an int,
not a DeviceAlias)."""

from __future__ import annotations

from pointerdomain import DeviceAlias, HostKVPool, KVLayout


def kinds(layout: KVLayout) -> None:
    layout.replace(kind="page_heads")  # type: ignore[arg-type]
    layout.replace(kind="page_unified", head_groups="2")  # type: ignore[arg-type]
    layout.byte_offset(0, 0, 0, 0)  # type: ignore[call-arg]
    layout.byte_offset(0, 0, 0, tok=1)  # type: ignore[call-arg]


def addresses(pool: HostKVPool) -> None:
    alias: DeviceAlias = pool.host_va(0, 0, 0)  # type: ignore[assignment]
    raw: int = pool.host_va(0, 0, 0)  # type: ignore[assignment]
    print(alias, raw)
