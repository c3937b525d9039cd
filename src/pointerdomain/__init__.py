"""pointerdomain: host VAs and device aliases as distinct types, pointer tables
that carry their domain and device, registered host memory, and KV-cache
transfer kernels that accept only device aliases.

See docs/design.md for the two address domains and the rules.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pointerdomain import checked, errors
    from pointerdomain.domains import Address, Device, DeviceAlias, HostVA, as_device
    from pointerdomain.guard import DeviceGuard
    from pointerdomain.kernels import transfer_kv_all_layer, transfer_kv_per_layer
    from pointerdomain.layouts import KVLayout
    from pointerdomain.memory import RegisteredHostMemory, alloc_registered, device_empty, register_host_tensor
    from pointerdomain.metadata import BufferInfo, buffer_infos, page_buffer_meta
    from pointerdomain.pools import DeviceKVPool, HostKVPool
    from pointerdomain.resolve import AliasPolicy, alias_policy, fallback_count, reset_resolver_cache, resolve_alias
    from pointerdomain.tables import PointerTable, host_ptr_table, make_kernel_ptr_table

# Imported on first use (PEP 562), so `pointerdomain.audit` and the CLI's audit command
# start without torch. Each public name -> the module that defines it.
_LAZY = {
    "checked": "pointerdomain.checked", "errors": "pointerdomain.errors",
    "Address": "pointerdomain.domains", "Device": "pointerdomain.domains", "DeviceAlias": "pointerdomain.domains",
    "HostVA": "pointerdomain.domains", "as_device": "pointerdomain.domains",
    "DeviceGuard": "pointerdomain.guard",
    "transfer_kv_all_layer": "pointerdomain.kernels", "transfer_kv_per_layer": "pointerdomain.kernels",
    "KVLayout": "pointerdomain.layouts",
    "RegisteredHostMemory": "pointerdomain.memory", "alloc_registered": "pointerdomain.memory",
    "device_empty": "pointerdomain.memory", "register_host_tensor": "pointerdomain.memory",
    "BufferInfo": "pointerdomain.metadata", "buffer_infos": "pointerdomain.metadata",
    "page_buffer_meta": "pointerdomain.metadata",
    "DeviceKVPool": "pointerdomain.pools", "HostKVPool": "pointerdomain.pools",
    "AliasPolicy": "pointerdomain.resolve", "alias_policy": "pointerdomain.resolve",
    "fallback_count": "pointerdomain.resolve", "reset_resolver_cache": "pointerdomain.resolve",
    "resolve_alias": "pointerdomain.resolve",
    "PointerTable": "pointerdomain.tables", "host_ptr_table": "pointerdomain.tables",
    "make_kernel_ptr_table": "pointerdomain.tables",
}


if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt name stays a static error

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'pointerdomain' has no attribute {name!r}")
        import importlib

        mod = importlib.import_module(module)
        value = mod if module.rsplit(".", 1)[-1] == name else getattr(mod, name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "Address",
    "AliasPolicy",
    "BufferInfo",
    "Device",
    "DeviceAlias",
    "DeviceGuard",
    "DeviceKVPool",
    "HostKVPool",
    "HostVA",
    "KVLayout",
    "PointerTable",
    "RegisteredHostMemory",
    "__version__",
    "alias_policy",
    "alloc_registered",
    "as_device",
    "buffer_infos",
    "checked",
    "device_empty",
    "errors",
    "fallback_count",
    "host_ptr_table",
    "make_kernel_ptr_table",
    "page_buffer_meta",
    "register_host_tensor",
    "reset_resolver_cache",
    "resolve_alias",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer",
]
