"""pointerdomain: host VAs and device aliases as distinct types, pointer tables
that carry their domain and device, registered host memory, and KV-cache
transfer kernels that accept only device aliases.

See docs/design.md for the two address domains and the rules.
"""

from pointerdomain import checked, errors
from pointerdomain.devices import Device, DeviceGuard, as_device, external_stream, validate_device
from pointerdomain.domains import Address, DeviceAlias, HostVA
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
from pointerdomain.explain import Explanation, explain
from pointerdomain.layouts import KVLayout
from pointerdomain.memory import RegisteredHostMemory, find_registration, register_host_tensor
from pointerdomain.metadata import BufferInfo, buffer_infos, page_buffer_meta
from pointerdomain.pools import DeviceKVPool, DevicePool, HostKVPool
from pointerdomain.resolve import AliasPolicy, alias_policy, fallback_count, reset_resolver_cache, resolve_alias
from pointerdomain.tables import PointerTable, host_ptr_table, make_kernel_ptr_table, require_domain

__version__ = "0.1.0"


def get_include() -> str:
    """Directory of the C++ headers for third-party extensions and kernels
    (``pointerdomain/pointerdomain.h``: HostVA, DeviceAlias, KernelTable;
    ``pointerdomain/nanobind.h``: the nanobind casters). Add it to the include path
    (``target_include_directories(... PRIVATE ${dir})``); see docs/embedding.md."""
    from pathlib import Path

    return str(Path(__file__).resolve().parent / "include")

__all__ = [
    "Address",
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
    "MaxCtas",
    "PointerTable",
    "RegisteredHostMemory",
    "TransferBackend",
    "WHOLE_GPU",
    "WholeGpu",
    "__version__",
    "alias_policy",
    "alloc_registered",
    "as_device",
    "buffer_infos",
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
    "make_kernel_ptr_table",
    "memory_device",
    "memory_device_at",
    "page_buffer_meta",
    "register_host_tensor",
    "require_domain",
    "reset_resolver_cache",
    "resolve_alias",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer",
    "validate_device",
]
