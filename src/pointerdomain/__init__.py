"""pointerdomain: host VAs and device aliases as distinct types, pointer tables
that carry their domain and device, registered host memory, and KV-cache
transfer kernels that accept only device aliases.

See docs/design.md for the two address domains and the rules.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pointerdomain import checked, errors, ladder, staged
    from pointerdomain.devices import Device, DeviceGuard, as_device, external_stream, validate_device
    from pointerdomain.domains import Address, AddressT, DeviceAlias, HostVA
    from pointerdomain.kernels import (
        DEFAULT_MAX_CTAS,
        WHOLE_GPU,
        MaxCtas,
        TransferBackend,
        WholeGpu,
        index_tensor,
        transfer_kv_all_layer,
        transfer_kv_per_layer,
    )
    from pointerdomain.allocation import alloc_registered, device_empty, memory_device, memory_device_at
    from pointerdomain.explanation import Explanation, explain
    from pointerdomain.launch_errors import check_errors, synchronize
    from pointerdomain.ladder import RegistrationPolicy, Rung
    from pointerdomain.layouts import KVLayout, KVLayoutChanges
    from pointerdomain.memory import RegisteredHostMemory, find_registration, register_host_tensor
    from pointerdomain.metadata import BufferInfo, buffer_infos, page_buffer_meta
    from pointerdomain.pools import DeviceKVPool, DevicePool, HostKVPool
    from pointerdomain.strict import StrictCapability, strict_alias, strict_alias_enabled, strict_mode_capability
    from pointerdomain.resolve import AliasPolicy, alias_policy, fallback_count, reset_resolver_cache, resolve_alias
    from pointerdomain.tables import (
        PointerTable,
        host_ptr_table,
        is_host_table,
        is_kernel_table,
        make_kernel_ptr_table,
        require_domain,
    )

# Imported on first use (PEP 562), so `pointerdomain.audit` and the CLI's audit command
# start without torch. Each public name -> the module that defines it; keep it in step
# with the imports above (tests/test_package.py checks both against __all__).
_LAZY = {
    "checked": "pointerdomain.checked",
    "errors": "pointerdomain.errors",
    "ladder": "pointerdomain.ladder",
    "staged": "pointerdomain.staged",
    "RegistrationPolicy": "pointerdomain.ladder",
    "Rung": "pointerdomain.ladder",
    "StrictCapability": "pointerdomain.strict",
    "strict_alias": "pointerdomain.strict",
    "strict_alias_enabled": "pointerdomain.strict",
    "strict_mode_capability": "pointerdomain.strict",
    "Device": "pointerdomain.devices",
    "DeviceGuard": "pointerdomain.devices",
    "as_device": "pointerdomain.devices",
    "external_stream": "pointerdomain.devices",
    "validate_device": "pointerdomain.devices",
    "Address": "pointerdomain.domains",
    "AddressT": "pointerdomain.domains",
    "DeviceAlias": "pointerdomain.domains",
    "HostVA": "pointerdomain.domains",
    "DEFAULT_MAX_CTAS": "pointerdomain.kernels",
    "WHOLE_GPU": "pointerdomain.kernels",
    "MaxCtas": "pointerdomain.kernels",
    "TransferBackend": "pointerdomain.kernels",
    "WholeGpu": "pointerdomain.kernels",
    "index_tensor": "pointerdomain.kernels",
    "transfer_kv_all_layer": "pointerdomain.kernels",
    "transfer_kv_per_layer": "pointerdomain.kernels",
    "alloc_registered": "pointerdomain.allocation",
    "device_empty": "pointerdomain.allocation",
    "memory_device": "pointerdomain.allocation",
    "memory_device_at": "pointerdomain.allocation",
    "Explanation": "pointerdomain.explanation",
    "explain": "pointerdomain.explanation",
    "check_errors": "pointerdomain.launch_errors",
    "synchronize": "pointerdomain.launch_errors",
    "KVLayout": "pointerdomain.layouts",
    "KVLayoutChanges": "pointerdomain.layouts",
    "RegisteredHostMemory": "pointerdomain.memory",
    "find_registration": "pointerdomain.memory",
    "register_host_tensor": "pointerdomain.memory",
    "BufferInfo": "pointerdomain.metadata",
    "buffer_infos": "pointerdomain.metadata",
    "page_buffer_meta": "pointerdomain.metadata",
    "DeviceKVPool": "pointerdomain.pools",
    "DevicePool": "pointerdomain.pools",
    "HostKVPool": "pointerdomain.pools",
    "AliasPolicy": "pointerdomain.resolve",
    "alias_policy": "pointerdomain.resolve",
    "fallback_count": "pointerdomain.resolve",
    "reset_resolver_cache": "pointerdomain.resolve",
    "resolve_alias": "pointerdomain.resolve",
    "PointerTable": "pointerdomain.tables",
    "host_ptr_table": "pointerdomain.tables",
    "is_host_table": "pointerdomain.tables",
    "is_kernel_table": "pointerdomain.tables",
    "make_kernel_ptr_table": "pointerdomain.tables",
    "require_domain": "pointerdomain.tables",
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


from pointerdomain.buildinfo import version as _version

__version__: str = _version()  # from the git tag at build time (pointerdomain.buildinfo)


def get_include() -> str:
    """Directory of the C++ headers for third-party extensions and kernels
    (``pointerdomain/pointerdomain.h``: HostVA, DeviceAlias, KernelTable;
    ``pointerdomain/nanobind.h``: the nanobind casters). Add it to the include path
    (``target_include_directories(... PRIVATE ${dir})``); see docs/embedding.md."""
    from pathlib import Path

    return str(Path(__file__).resolve().parent / "include")


__all__ = [
    "Address",
    "AddressT",
    "AliasPolicy",
    "BufferInfo",
    "DEFAULT_MAX_CTAS",
    "Device",
    "DeviceAlias",
    "DeviceGuard",
    "DeviceKVPool",
    "Explanation",
    "DevicePool",
    "HostKVPool",
    "HostVA",
    "KVLayout",
    "KVLayoutChanges",
    "MaxCtas",
    "PointerTable",
    "RegisteredHostMemory",
    "RegistrationPolicy",
    "Rung",
    "StrictCapability",
    "TransferBackend",
    "WHOLE_GPU",
    "WholeGpu",
    "__version__",
    "alias_policy",
    "alloc_registered",
    "as_device",
    "buffer_infos",
    "check_errors",
    "checked",
    "device_empty",
    "errors",
    "explain",
    "external_stream",
    "fallback_count",
    "find_registration",
    "get_include",
    "host_ptr_table",
    "index_tensor",
    "is_host_table",
    "is_kernel_table",
    "ladder",
    "make_kernel_ptr_table",
    "memory_device",
    "memory_device_at",
    "page_buffer_meta",
    "register_host_tensor",
    "require_domain",
    "reset_resolver_cache",
    "resolve_alias",
    "staged",
    "synchronize",
    "strict_alias",
    "strict_alias_enabled",
    "strict_mode_capability",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer",
    "validate_device",
]
