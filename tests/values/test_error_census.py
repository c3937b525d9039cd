"""The error census: every public function and class of
``pointerdomain.__all__`` and of the adapters' ``__all__`` is called with bad input of
each kind; each call must raise a ``PointerDomainError`` that is also the matching
builtin, and its message must name the argument, the value found, what was expected
and the fix. A public name missing from the table fails :func:`test_every_public_name_is_in_the_census`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import lmcache, mooncake, nixl, sglang, vllm
from tests.reference import DEV, model_layout

LAYOUT = model_layout("layer_first", pages=4)
HOST_LAYOUT = model_layout("page_first", pages=4)


def _layer_load() -> pd.LayerLoad:
    """A real LayerLoad (three layers on the emulated device), its pools closed after."""
    pool = pd.DeviceKVPool(LAYOUT, DEV)
    with pd.HostKVPool(HOST_LAYOUT, DEV) as host:
        return host.load_layers(pool, torch.arange(2), torch.arange(2))

#: Public names that take no input that could be bad (constants, types, modules,
#: zero-argument queries) or are built only by other public functions.
EXEMPT = {
    "pointerdomain": {"DEFAULT_MAX_CTAS", "DevicePool", "MaxCtas", "TransferBackend", "WHOLE_GPU", "WholeGpu",
                      "__version__", "checked", "errors", "fallback_count", "get_include", "reset_resolver_cache",
                      "AliasPolicy", "PointerTable", "RegisteredHostMemory",
                      "KVLayoutChanges", "BufferInfoChanges",  # TypedDicts (static only)
                      "is_host_table", "is_kernel_table", "has_domain",  # predicates: False for any other object
                      "Rung", "StrictCapability", "strict_alias_enabled",
                      "Explanation"},  # a result record built by explain()  # an enum, a result record, a query  # predicates: False for any other object
    "pointerdomain.adapters.mooncake": {"EngineUnavailableError", "TransferEngineLike", "BatchTransferEngineLike",
                                        "RpcPortEngineLike"},  # + Protocols
    "pointerdomain.adapters.nixl": {"MemType", "NixlUnavailableError", "NixlRegistration", "HostNixlAgent",
                                    "NixlAgentLike"},  # + a Protocol
    "pointerdomain.adapters.sglang": {"ContiguousBufInfos", "PageBufferMeta", "MHADevicePool", "MLADevicePool",
                                      "SglangHostPool"},
    "pointerdomain.adapters.vllm": {"BatchCopyFn", "BlockCopyBatch"},
    "pointerdomain.adapters.lmcache": {"TensorKey"},
}

# (public name, case id, call, builtin, needles: argument, value found, expected, fix)
Case = tuple[str, str, Callable[[], Any], type[BaseException], tuple[str, ...]]
CASES: list[Case] = [
    ("pointerdomain.Address", "abstract", lambda: pd.Address(4096), TypeError, ("Address", "abstract", "HostVA")),
    ("pointerdomain.HostVA", "str", lambda: pd.HostVA("0x1000"), TypeError, ("str", "int")),
    ("pointerdomain.HostVA", "negative", lambda: pd.HostVA(-1), ValueError, ("-0x1", "2**64")),
    ("pointerdomain.DeviceAlias", "str-device", lambda: pd.DeviceAlias(4096, "emulated:0"), ValueError,
     ("Device", "'emulated:0'")),
    ("pointerdomain.Device", "type", lambda: pd.Device("tpu", 0), ValueError, ("'tpu'", "expected")),  # type: ignore[arg-type]
    ("pointerdomain.Device", "ordinal", lambda: pd.Device("cuda", -1), ValueError, ("ordinal", "-1", ">= 0")),
    ("pointerdomain.as_device", "unknown", lambda: pd.as_device("tpu:0"), ValueError, ("'tpu:0'", "expected")),
    ("pointerdomain.as_device", "ordinal", lambda: pd.as_device("emulated:x"), ValueError, ("'emulated:x'", "ordinal")),
    ("pointerdomain.validate_device", "missing", lambda: pd.validate_device("emulated:99"), ValueError,
     ("emulated:99", "does not exist", "2 emulated")),
    ("pointerdomain.DeviceGuard", "missing", lambda: pd.DeviceGuard("emulated:99"), ValueError, ("emulated:99",)),
    ("pointerdomain.external_stream", "device", lambda: pd.external_stream("cuda:0", 1), ValueError,  # type: ignore[arg-type]
     ("device", "'cuda:0'", "expected", "Fix")),
    ("pointerdomain.external_stream", "stream", lambda: pd.external_stream(DEV, -5), ValueError,
     ("stream", "-5", "expected", "Fix")),
    ("pointerdomain.KVLayout", "head_dim", lambda: pd.KVLayout(**(LAYOUT.model_dump() | {"head_dim": -8})), ValueError,
     ("head_dim", "-8", "expected", "Fix")),
    ("pointerdomain.KVLayout", "dtype", lambda: LAYOUT.replace(dtype=torch.float16), ValueError,
     ("dtype", "torch.float16", "expected", "Fix")),
    ("pointerdomain.BufferInfo", "past-2**64",
     lambda: pd.BufferInfo(address=pd.HostVA(2**64 - 64), nbytes=128, item_bytes=64), ValueError,
     ("HostVA(0xffffffffffffffc0)", "+128", "past 2**64", "Fix")),
    ("pointerdomain.BufferInfo", "copy-alias",
     lambda: pd.BufferInfo(address=pd.HostVA(4096), nbytes=128, item_bytes=64).model_copy(
         update={"address": pd.DeviceAlias(4096, DEV)}),  # type: ignore[arg-type]
     ValueError, ("address", "HostVA", "DeviceAlias")),
    ("pointerdomain.BufferInfo", "int-address", lambda: pd.BufferInfo(address=4096, nbytes=8, item_bytes=8),  # type: ignore[arg-type]
     ValueError, ("address", "4096", "HostVA", "Fix")),
    ("pointerdomain.alloc_registered", "zero", lambda: pd.alloc_registered(0, DEV), ValueError, ("nbytes", "0")),
    ("pointerdomain.alloc_registered", "huge", lambda: pd.alloc_registered(1 << 50, DEV), MemoryError,
     ("nbytes", str(1 << 50), "expected", "Fix")),
    ("pointerdomain.alloc_registered", "granularity", lambda: pd.alloc_registered(4096, DEV, granularity=0), ValueError,
     ("granularity", "0", "positive int")),
    ("pointerdomain.device_empty", "shape", lambda: pd.device_empty("4", torch.uint8, DEV), TypeError,  # type: ignore[arg-type]
     ("shape", "'4'", "expected", "Fix")),
    ("pointerdomain.device_empty", "dtype", lambda: pd.device_empty((4,), "uint8", DEV), TypeError,  # type: ignore[arg-type]
     ("dtype", "'uint8'", "expected", "Fix")),
    ("pointerdomain.device_empty", "negative", lambda: pd.device_empty((-1,), torch.uint8, DEV), ValueError,
     ("shape", "(-1,)", "expected", "Fix")),
    ("pointerdomain.device_empty", "huge", lambda: pd.device_empty((1 << 50,), torch.uint8, DEV), MemoryError,
     ("nbytes", str(1 << 50), "expected", "Fix")),
    ("pointerdomain.memory_device", "not-tensor", lambda: pd.memory_device("x"), TypeError,  # type: ignore[arg-type]
     ("tensor", "str", "expected", "Fix")),
    ("pointerdomain.memory_device_at", "str", lambda: pd.memory_device_at("x", 1), ValueError,  # type: ignore[arg-type]
     ("address", "'x'", "expected", "Fix")),
    ("pointerdomain.memory_device_at", "huge", lambda: pd.memory_device_at(1 << 70, 1), ValueError,
     ("address", str(1 << 70), "expected", "Fix")),
    ("pointerdomain.register_host_tensor", "list", lambda: pd.register_host_tensor([1, 2], DEV), ValueError,  # type: ignore[arg-type]
     ("torch.Tensor", "list")),
    ("pointerdomain.register_host_tensor", "empty", lambda: pd.register_host_tensor(torch.zeros(0), DEV), ValueError,
     ("empty",)),
    ("pointerdomain.register_host_tensor", "strided", lambda: pd.register_host_tensor(torch.zeros(4, 4)[:, 0], DEV),
     ValueError, ("strided", "(4,)")),
    ("pointerdomain.explain", "str", lambda: pd.explain("0x1000"), ValueError,  # type: ignore[arg-type]
     ("explain", "'0x1000'", "int")),
    ("pointerdomain.find_registration", "int", lambda: pd.find_registration(4096), TypeError,  # type: ignore[arg-type]
     ("va", "int", "expected", "Fix")),
    ("pointerdomain.find_registration", "nbytes", lambda: pd.find_registration(pd.HostVA(4096), -1), ValueError,
     ("nbytes", "-1", "expected", "Fix")),
    ("pointerdomain.resolve_alias", "int", lambda: pd.resolve_alias(4096, DEV), TypeError, ("HostVA", "int")),  # type: ignore[arg-type]
    ("pointerdomain.alias_policy", "device", lambda: pd.alias_policy("tpu:0"), ValueError, ("'tpu:0'",)),
    ("pointerdomain.make_kernel_ptr_table", "bare", lambda: pd.make_kernel_ptr_table(torch.zeros(4, 4), DEV),  # type: ignore[arg-type]
     TypeError, ("tensors", "bare torch.Tensor", "expected", "Fix")),
    ("pointerdomain.make_kernel_ptr_table", "item", lambda: pd.make_kernel_ptr_table([3], DEV), TypeError,  # type: ignore[list-item]
     ("tensors[0]", "int", "expected", "Fix")),
    ("pointerdomain.make_kernel_ptr_table", "unregistered", lambda: pd.make_kernel_ptr_table([torch.zeros(8)], DEV),
     TypeError, ("tensors[0]", "unregistered host memory", "HostVA", "register_host_tensor")),
    ("pointerdomain.make_kernel_ptr_table", "empty", lambda: pd.make_kernel_ptr_table([torch.zeros(0)], DEV),
     ValueError, ("tensors[0]", "empty", "expected", "Fix")),
    ("pointerdomain.host_ptr_table", "bare", lambda: pd.host_ptr_table(torch.zeros(2, 2)), TypeError,  # type: ignore[arg-type]
     ("tensors", "bare torch.Tensor", "expected", "Fix")),
    ("pointerdomain.host_ptr_table", "device", lambda: pd.host_ptr_table([pd.device_empty((4,), torch.uint8, DEV)]),
     TypeError, ("tensors[0]", "emulated:0", "host memory")),
    ("pointerdomain.require_domain", "int", lambda: pd.require_domain("t", 3, pd.HostVA, "metadata", "why"), TypeError,
     ("t", "int", "expected a PointerTable[HostVA]")),
    ("pointerdomain.index_tensor", "float", lambda: pd.index_tensor("ids", [1.5]), IndexError, ("ids", "float", "int")),
    ("pointerdomain.index_tensor", "2-d", lambda: pd.index_tensor("ids", torch.zeros(2, 2, dtype=torch.int64)),
     IndexError, ("ids", "(2, 2)", "1-D")),
    ("pointerdomain.buffer_infos", "int", lambda: pd.buffer_infos(3, 8), TypeError, ("table", "int", "HostVA")),  # type: ignore[arg-type]
    ("pointerdomain.page_buffer_meta", "int", lambda: pd.page_buffer_meta(3, HOST_LAYOUT, [0]), TypeError,  # type: ignore[arg-type]
     ("table", "int", "HostVA")),
    ("pointerdomain.DeviceKVPool", "layout", lambda: pd.DeviceKVPool("layer_first", DEV), ValueError,  # type: ignore[arg-type]
     ("layout", "str", "KVLayout")),
    ("pointerdomain.DeviceKVPool", "kind", lambda: pd.DeviceKVPool(HOST_LAYOUT, DEV), ValueError, ("layer_first", "page_first")),
    ("pointerdomain.HostKVPool", "layout", lambda: pd.HostKVPool(None, DEV), ValueError, ("layout", "NoneType", "KVLayout")),  # type: ignore[arg-type]
    ("pointerdomain.HostKVPool", "huge", lambda: pd.HostKVPool(LAYOUT.replace(num_pages=1 << 40), DEV), MemoryError,
     ("nbytes", "expected", "Fix")),
    ("pointerdomain.transfer_kv_all_layer", "table", lambda: pd.transfer_kv_all_layer(  # type: ignore[arg-type]
        3, 3, torch.arange(2), torch.arange(2), src_layout=LAYOUT, dst_layout=LAYOUT), TypeError,
     ("src", "int", "PointerTable[DeviceAlias]", "make_kernel_ptr_table")),
    ("pointerdomain.load_layers", "table", lambda: pd.load_layers(  # type: ignore[arg-type]
        3, 3, torch.arange(2), torch.arange(2), src_layout=LAYOUT, dst_layout=LAYOUT), TypeError,
     ("src", "int", "PointerTable[DeviceAlias]", "make_kernel_ptr_table")),
    ("pointerdomain.LayerLoad", "layer", lambda: _layer_load().wait(99), IndexError, ("layer", "99", "outside")),
    ("pointerdomain.transfer_kv_per_layer", "layer", lambda: pd.transfer_kv_per_layer(  # type: ignore[arg-type]
        3, 3, torch.arange(2), torch.arange(2), layer_id="0", src_layout=LAYOUT, dst_layout=LAYOUT), IndexError,
     ("layer_id", "'0'", "int")),
    ("pointerdomain.transfer.checked.set_enabled", "str", lambda: pd.checked.set_enabled("yes"), ValueError,  # type: ignore[arg-type]
     ("'yes'", "bool")),
    ("pointerdomain.check_errors", "device", lambda: pd.check_errors("tpu:0"), ValueError, ("'tpu:0'", "expected")),
    ("pointerdomain.synchronize", "device", lambda: pd.synchronize("tpu:0"), ValueError, ("'tpu:0'", "expected")),
    ("pointerdomain.strict_mode_capability", "device", lambda: pd.strict_mode_capability("tpu:0"), ValueError,
     ("'tpu:0'", "expected")),
    ("pointerdomain.strict_alias", "str", lambda: pd.strict_alias("yes"), ValueError, ("'yes'", "bool")),  # type: ignore[arg-type]
    ("pointerdomain.RegistrationPolicy", "on_failure", lambda: pd.RegistrationPolicy(on_failure="x"), ValueError,  # type: ignore[arg-type]
     ("on_failure", "'x'")),
    # adapters
    ("pointerdomain.adapters.mooncake.as_host_va", "int", lambda: mooncake.as_host_va(4096, "addr"), TypeError,
     ("addr", "int", "HostVA")),
    ("pointerdomain.adapters.mooncake.HostTransferEngine", "nbytes",
     lambda: mooncake.HostTransferEngine(object(), "h:1").register_memory(pd.HostVA(4096), 0), ValueError,
     ("nbytes", "0", "expected", "Fix")),
    ("pointerdomain.adapters.nixl.dram_desc", "int", lambda: nixl.dram_desc(4096, 8), TypeError, ("int", "HostVA")),  # type: ignore[arg-type]
    ("pointerdomain.adapters.nixl.dram_desc", "past-2**64", lambda: nixl.dram_desc(pd.HostVA(2**64 - 8), 64), ValueError,
     ("HostVA(0xfffffffffffffff8)", "+64", "past 2**64", "Fix")),
    ("pointerdomain.adapters.nixl.vram_desc", "str", lambda: nixl.vram_desc("x", DEV), ValueError, ("emulated:0", "cuda")),  # type: ignore[arg-type]
    ("pointerdomain.adapters.nixl.file_desc", "fd", lambda: nixl.file_desc(-1, 0, 8), ValueError, ("fd", "-1", "expected", "Fix")),
    ("pointerdomain.adapters.nixl.file_region", "fd", lambda: nixl.file_region("x", 8), ValueError, ("fd", "'x'")),  # type: ignore[arg-type]
    ("pointerdomain.adapters.nixl.NixlDesc", "token", lambda: nixl.NixlDesc(None, "DRAM", 0, 8, 0), TypeError,  # type: ignore[arg-type]
     ("dram_desc",)),
    ("pointerdomain.adapters.sglang.make_kernel_ptr_table", "bare",
     lambda: sglang.make_kernel_ptr_table(torch.zeros(4, 4), DEV, host_memory_registered=True), TypeError, ("bare torch.Tensor",)),  # type: ignore[arg-type]
    ("pointerdomain.adapters.sglang.HostKVCacheAdapter", "buffer",
     lambda: sglang.HostKVCacheAdapter("x", HOST_LAYOUT, DEV), TypeError, ("kv_buffer", "str", "expected", "Fix")),  # type: ignore[arg-type]
    ("pointerdomain.adapters.sglang.DeviceKVBuffers", "buffers",
     lambda: sglang.DeviceKVBuffers([torch.zeros(2, 2)], None, DEV, page_size=4), ValueError,
     ("k_buffer[0]", "(2, 2)", "must be")),
    ("pointerdomain.adapters.sglang.DeviceKVBuffers", "bare-tensor",
     lambda: sglang.DeviceKVBuffers(torch.zeros(2, 2), None, DEV, page_size=4), TypeError,  # type: ignore[arg-type]
     ("k_buffer", "Tensor", "expected", "Fix")),
    ("pointerdomain.adapters.sglang.sglang_host_shape", "layout",
     lambda: sglang.sglang_host_shape("layer_first"), TypeError, ("layout", "str", "expected", "Fix")),  # type: ignore[arg-type]
    ("pointerdomain.adapters.vllm.block_copy_batch", "table",
     lambda: vllm.block_copy_batch(3, 3, torch.arange(2), torch.arange(2), block_bytes=64), TypeError,
     ("int", "DeviceAlias")),  # type: ignore[arg-type]
    ("pointerdomain.adapters.vllm.run_batch_copy", "batch", lambda: vllm.run_batch_copy(3, print), TypeError,  # type: ignore[arg-type]
     ("int", "BlockCopyBatch")),
    ("pointerdomain.adapters.vllm.CpuGpuBlockOffload", "tensors",
     lambda: vllm.CpuGpuBlockOffload(torch.zeros(4), torch.zeros(4), DEV), TypeError, ("bare torch.Tensor",)),  # type: ignore[arg-type]
    ("pointerdomain.adapters.lmcache.LayerPointerCache", "get",
     lambda: lmcache.LayerPointerCache().get(torch.zeros(2, 2), DEV), TypeError, ("bare torch.Tensor",)),  # type: ignore[arg-type]
    ("pointerdomain.adapters.lmcache.PagedKVConnector", "layout",
     lambda: lmcache.PagedKVConnector().from_gpu(torch.zeros(4), 0, 2, kvcaches=torch.zeros(2, 2),
                                                 slot_mapping=torch.arange(2), device=DEV), ValueError, ("kvcaches[0]", "(2,)", "expected")),  # type: ignore[arg-type]
]

_BUILTINS = (TypeError, ValueError, IndexError, MemoryError, RuntimeError, ImportError)


@pytest.mark.parametrize(("name", "case", "call", "builtin", "needles"), CASES,
                         ids=[f"{n.removeprefix('pointerdomain.')}-{c}" for n, c, *_ in CASES])
def test_bad_input_gets_a_typed_error(name: str, case: str, call: Callable[[], Any], builtin: type[BaseException],
                                      needles: tuple[str, ...]) -> None:
    with pytest.raises(BaseException) as info:
        call()
    exc = info.value
    assert isinstance(exc, errors.PointerDomainError), f"{name} ({case}): {type(exc).__mro__} {exc}"
    assert isinstance(exc, builtin), f"{name} ({case}): {type(exc).__name__} is not a {builtin.__name__}"
    assert any(isinstance(exc, b) for b in _BUILTINS)
    text = str(exc)
    for needle in needles:
        assert needle.lower() in text.lower(), f"{name} ({case}): {needle!r} not in {text!r}"


def _public(module: Any, prefix: str) -> set[str]:
    return {f"{prefix}.{n}" for n in module.__all__ if not n.startswith("_")}


def test_every_public_name_is_in_the_census() -> None:
    covered = {name for name, *_ in CASES}
    modules = {"pointerdomain": pd, "pointerdomain.adapters.mooncake": mooncake, "pointerdomain.adapters.nixl": nixl,
               "pointerdomain.adapters.sglang": sglang, "pointerdomain.adapters.vllm": vllm,
               "pointerdomain.adapters.lmcache": lmcache}
    missing = []
    for prefix, module in modules.items():
        for full in sorted(_public(module, prefix)):
            short = full.removeprefix(prefix + ".")
            obj = getattr(module, short)
            if short in EXEMPT.get(prefix, set()) or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if full not in covered:
                missing.append(full)
    assert not missing, f"public names without a census case: {missing}"


def test_every_error_class_is_inside_the_tree_and_a_builtin() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not isinstance(cls, type):
            continue  # a helper (with_address), not an error class
        assert issubclass(cls, errors.PointerDomainError)
        if cls is not errors.PointerDomainError:
            assert any(issubclass(cls, b) for b in _BUILTINS), name
