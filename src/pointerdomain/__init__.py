"""pointerdomain: host VAs and device aliases as distinct types, pointer tables
that carry their domain and device, registered host memory, and KV-cache
transfer kernels that accept only device aliases.

See docs/design.md for the two address domains and the rules.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pointerdomain import errors
    from pointerdomain.registration import ladder
    from pointerdomain.transfer import checked, staged
    from pointerdomain.devices import Device, DeviceGuard, as_device, external_stream, validate_device
    from pointerdomain.domains import Address, AddressT, DeviceAlias, HostVA
    from pointerdomain.transfer.kernels import (
        DEFAULT_MAX_CTAS,
        WHOLE_GPU,
        MaxCtas,
        TransferBackend,
        WholeGpu,
        index_tensor,
        transfer_kv_all_layer,
        transfer_kv_per_layer,
    )
    from pointerdomain.registration.allocation import alloc_registered, device_empty, memory_device, memory_device_at
    from pointerdomain.explained import Explanation
    from pointerdomain.tools.explanation import explain
    from pointerdomain.transfer.launch_errors import check_errors, synchronize
    from pointerdomain.registration.ladder import RegistrationPolicy, Rung
    from pointerdomain.layouts import KVLayout, KVLayoutChanges
    from pointerdomain.registration.memory import RegisteredHostMemory, find_registration, register_host_tensor
    from pointerdomain.registration.metadata import BufferInfo, BufferInfoChanges, buffer_infos, page_buffer_meta
    from pointerdomain.transfer.layers import LayerLoad, load_layers
    from pointerdomain.transfer.pools import DeviceKVPool, DevicePool, HostKVPool
    from pointerdomain.registration.strict import StrictCapability, strict_alias, strict_alias_enabled, strict_mode_capability
    from pointerdomain.registration.resolve import AliasPolicy, alias_policy, fallback_count, reset_resolver_cache, resolve_alias
    from pointerdomain.registration.tables import (
        PointerTable,
        has_domain,
        host_ptr_table,
        is_host_table,
        is_kernel_table,
        make_kernel_ptr_table,
        require_domain,
    )

# Imported on first use (PEP 562), so `pointerdomain.audit` and the CLI's audit command
# start without torch. Each public name -> the module that defines it; keep it in step
# with the imports above (tests/values/test_package.py checks both against __all__).
_LAZY = {
    "checked": "pointerdomain.transfer.checked",
    "errors": "pointerdomain.errors",
    "ladder": "pointerdomain.registration.ladder",
    "staged": "pointerdomain.transfer.staged",
    "RegistrationPolicy": "pointerdomain.registration.ladder",
    "Rung": "pointerdomain.registration.ladder",
    "StrictCapability": "pointerdomain.registration.strict",
    "strict_alias": "pointerdomain.registration.strict",
    "strict_alias_enabled": "pointerdomain.registration.strict",
    "strict_mode_capability": "pointerdomain.registration.strict",
    "Device": "pointerdomain.devices",
    "DeviceGuard": "pointerdomain.devices",
    "as_device": "pointerdomain.devices",
    "external_stream": "pointerdomain.devices",
    "validate_device": "pointerdomain.devices",
    "Address": "pointerdomain.domains",
    "AddressT": "pointerdomain.domains",
    "DeviceAlias": "pointerdomain.domains",
    "HostVA": "pointerdomain.domains",
    "DEFAULT_MAX_CTAS": "pointerdomain.transfer.kernels",
    "WHOLE_GPU": "pointerdomain.transfer.kernels",
    "MaxCtas": "pointerdomain.transfer.kernels",
    "TransferBackend": "pointerdomain.transfer.kernels",
    "WholeGpu": "pointerdomain.transfer.kernels",
    "index_tensor": "pointerdomain.transfer.kernels",
    "transfer_kv_all_layer": "pointerdomain.transfer.kernels",
    "transfer_kv_per_layer": "pointerdomain.transfer.kernels",
    "alloc_registered": "pointerdomain.registration.allocation",
    "device_empty": "pointerdomain.registration.allocation",
    "memory_device": "pointerdomain.registration.allocation",
    "memory_device_at": "pointerdomain.registration.allocation",
    "Explanation": "pointerdomain.explained",
    "explain": "pointerdomain.tools.explanation",
    "check_errors": "pointerdomain.transfer.launch_errors",
    "synchronize": "pointerdomain.transfer.launch_errors",
    "KVLayout": "pointerdomain.layouts",
    "KVLayoutChanges": "pointerdomain.layouts",
    "RegisteredHostMemory": "pointerdomain.registration.memory",
    "find_registration": "pointerdomain.registration.memory",
    "register_host_tensor": "pointerdomain.registration.memory",
    "BufferInfo": "pointerdomain.registration.metadata",
    "BufferInfoChanges": "pointerdomain.registration.metadata",
    "buffer_infos": "pointerdomain.registration.metadata",
    "page_buffer_meta": "pointerdomain.registration.metadata",
    "LayerLoad": "pointerdomain.transfer.layers",
    "load_layers": "pointerdomain.transfer.layers",
    "DeviceKVPool": "pointerdomain.transfer.pools",
    "DevicePool": "pointerdomain.transfer.pools",
    "HostKVPool": "pointerdomain.transfer.pools",
    "AliasPolicy": "pointerdomain.registration.resolve",
    "alias_policy": "pointerdomain.registration.resolve",
    "fallback_count": "pointerdomain.registration.resolve",
    "reset_resolver_cache": "pointerdomain.registration.resolve",
    "resolve_alias": "pointerdomain.registration.resolve",
    "PointerTable": "pointerdomain.registration.tables",
    "host_ptr_table": "pointerdomain.registration.tables",
    "has_domain": "pointerdomain.registration.tables",
    "is_host_table": "pointerdomain.registration.tables",
    "is_kernel_table": "pointerdomain.registration.tables",
    "make_kernel_ptr_table": "pointerdomain.registration.tables",
    "require_domain": "pointerdomain.registration.tables",
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


from pointerdomain import errors as _errors  # torch-free
from pointerdomain import _platform as _platform  # torch-free; installs each device type's runtime in devices


def _explain_address(address: int) -> "Explanation":
    """``PointerDomainError.explain()``'s lookup: errors, on the ground floor, import no
    tools, so the package installs it (the lookup imports torch on first use only)."""
    from pointerdomain.tools.explanation import explain as _explain

    return _explain(address)


_errors.set_explainer(_explain_address)

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
    "BufferInfoChanges",
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
    "LayerLoad",
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
    "has_domain",
    "host_ptr_table",
    "index_tensor",
    "is_host_table",
    "is_kernel_table",
    "ladder",
    "load_layers",
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
