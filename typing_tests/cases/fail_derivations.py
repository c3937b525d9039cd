"""Deriving a model: model_copy takes no update dict (a dict[str, Any] cannot be
checked field by field); replace(**changes) checks names and types. Not executed."""

from __future__ import annotations

from typing import Any

from pointerdomain import BufferInfo, DeviceAlias, HostVA, KVLayout
from pointerdomain.audit import AuditConfig


def copies(info: BufferInfo, layout: KVLayout, config: AuditConfig, alias: DeviceAlias, changes: dict[str, Any]) -> None:
    info.model_copy(update={"adress": alias})  # type: ignore[arg-type]
    info.model_copy(update={"address": alias})  # type: ignore[arg-type]
    info.model_copy(update={"nbytes": -1})  # type: ignore[arg-type]
    info.model_copy(update=changes)  # type: ignore[arg-type]
    layout.model_copy(update={"num_page": 8})  # type: ignore[arg-type]
    config.model_copy(update={"jobs": -1})  # type: ignore[arg-type]
    info.model_construct(address=alias)  # type: ignore[arg-type]


def replaces(info: BufferInfo, alias: DeviceAlias, va: HostVA) -> None:
    info.replace(adress=va)  # type: ignore[call-arg]
    info.replace(address=alias)  # type: ignore[arg-type]
    info.replace(address=0x1000)  # type: ignore[arg-type]
    info.replace(nbytes="64")  # type: ignore[arg-type]
    info.replace(item_bytes=None)  # type: ignore[arg-type]
    a: HostVA = info.replace(nbytes=64)  # type: ignore[assignment]
    del a
