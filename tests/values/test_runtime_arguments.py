"""Every public parameter is checked at run time, not only by the type checker.

The test walks the public signatures (``pointerdomain.__all__`` and the ``__all__`` of
the public modules of ``pointerdomain.adapters`` and ``pointerdomain.compat``), finds
each parameter typed by a ``Literal``, ``bool``, an enum or one of the package's own
classes (layouts, policies, pools), and calls the function with a misspelt or
wrong-typed value for it: a typed error naming the parameter must come back, and
nothing may be registered. A new parameter of these kinds fails the first test until
it has a sample call here (or an exemption with its reason).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import lmcache, mooncake, nixl, sglang, vllm
from pointerdomain.compat import lmcache as compat_lmcache
from pointerdomain.compat import vllm as compat_vllm
from pointerdomain.compat import wrap
from tests.reference import DEV, model_layout

ADDRESS_TYPES = {"Device", "HostVA", "DeviceAlias", "PointerTable", "BufferInfo", "WholeGpu", "NixlDesc"}


def _public_modules() -> list[str]:
    import pointerdomain.adapters as adapters
    import pointerdomain.compat as compat

    names = ["pointerdomain"]
    for package in (adapters, compat):
        names.append(package.__name__)
        names += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_")]
    return names


def _checked_kind(tp: object) -> bool:
    """A parameter type whose values a misspelling or a wrong type can silently pass."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_checked_kind(a) for a in typing.get_args(tp))
    if origin is typing.Literal or tp is bool:
        return True
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return True
        return (tp.__module__.startswith("pointerdomain") and tp.__name__ not in ADDRESS_TYPES
                and not getattr(tp, "_is_protocol", False))
    return False


def _functions(module: str) -> Iterator[tuple[str, Callable[..., Any]]]:
    mod = importlib.import_module(module)
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if inspect.isclass(obj):
            if getattr(obj, "_is_protocol", False):
                continue
            for attr, value in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                if inspect.isfunction(fn):
                    yield f"{obj.__qualname__}.{attr}", fn
            if "__init__" not in vars(obj) and hasattr(obj, "__dataclass_fields__"):
                yield f"{obj.__qualname__}.__init__", obj.__init__
        elif inspect.isfunction(obj):
            yield obj.__qualname__, obj


def discovered() -> set[str]:
    found: set[str] = set()
    for module in _public_modules():
        for qualname, fn in _functions(module):
            try:
                hints = typing.get_type_hints(fn)
            except Exception:  # a forward reference only a type checker resolves
                continue
            for param in inspect.signature(fn).parameters:
                if param in hints and _checked_kind(hints[param]):
                    found.add(f"{qualname}:{param}")
    return found


#: Parameters checked elsewhere or not callers' to give, with the reason.
EXEMPT = {
    "Explanation.__init__:domain": "built by explain(), a frozen record",
    "Explanation.__init__:state": "built by explain(), a frozen record",
    "StrictCapability.__init__:can_fault": "built by strict_mode_capability(), a frozen record",
    "RegisteredHostMemory.__init__:library_owned": "built by alloc_registered / register_host_tensor",
    "RegisteredHostMemory.__init__:policy": "built by alloc_registered / register_host_tensor (sampled there)",
    "RegisteredHostMemory.__init__:segment": "built by register_host_tensor (segments.segment_of)",
    "RegisteredHostMemory.__init__:prefaulted": "built by alloc_registered (its own prefault report)",
    "PointerTable.__init__:token": "a private token: built by make_kernel_ptr_table / host_ptr_table",
    "PointerTable.__init__:layout": "a private token: sampled through make_kernel_ptr_table",
    "NixlDesc.__init__:mem_type": "a private token: built by dram_desc / vram_desc / file_desc",
    "NixlRegistration.__init__:agent": "a private token: built by HostNixlAgent.register",
    "KernelOp.__init__:var_positional": "built by kernel_op() from the op's signature",
    "KernelOp.__init__:var_keyword": "built by kernel_op() from the op's signature",
    "KernelOp.__init__:table_tensor": "built by kernel_op() (sampled there)",
    "TransferChoice.__init__:host_indices": "built by explain_transfer(), a frozen record",
    "LayerLoad.__init__:words": "built by load_layers() (its completion words)",
}


class World:
    """Valid arguments for the sample calls (one small model on the emulated device)."""

    def __init__(self) -> None:
        self.layout = model_layout("layer_first")
        self.host_layout = model_layout("page_first")
        self.device = pd.DeviceKVPool(self.layout, DEV)
        self.host = pd.HostKVPool(self.host_layout, DEV)
        self.idx = torch.arange(4, dtype=torch.int64)
        self.cpu = torch.zeros(4096, dtype=torch.uint8)


Sample = Callable[[World, object], object]


def _transfer(per_layer: bool, **kw: object) -> Callable[[World], object]:
    def call(w: World) -> object:
        fn: Any = pd.transfer_kv_per_layer if per_layer else pd.transfer_kv_all_layer
        extra: dict[str, object] = {"layer_id": 0} if per_layer else {}
        return fn(w.host.kernel_table, w.device.table, w.idx, w.idx, src_layout=w.host_layout,
                  dst_layout=w.layout, **extra, **kw)
    return call


SAMPLES: dict[str, Sample] = {
    "Device.__init__:type": lambda w, v: pd.Device(v, 0),  # type: ignore[arg-type]
    "KVLayout.page_blocks:order": lambda w, v: w.host_layout.page_blocks(0, order=v),  # type: ignore[arg-type]
    "KVLayout.page_blocks:merge": lambda w, v: w.host_layout.page_blocks(0, merge=v),  # type: ignore[arg-type]
    "RegistrationPolicy.__init__:on_failure": lambda w, v: pd.RegistrationPolicy(on_failure=v),  # type: ignore[arg-type]
    "RegistrationPolicy.__init__:allow_pinned_copy":
        lambda w, v: pd.RegistrationPolicy(allow_pinned_copy=v),  # type: ignore[arg-type]
    "RegistrationPolicy.__init__:allow_unpinned": lambda w, v: pd.RegistrationPolicy(allow_unpinned=v),  # type: ignore[arg-type]
    "RegistrationPolicy.__init__:huge_pages": lambda w, v: pd.RegistrationPolicy(huge_pages=v),  # type: ignore[arg-type]
    "alloc_registered:numa": lambda w, v: pd.alloc_registered(4096, DEV, numa=v),  # type: ignore[arg-type]
    "alloc_registered:policy": lambda w, v: pd.alloc_registered(4096, DEV, policy=v),  # type: ignore[arg-type]
    "register_host_tensor:policy": lambda w, v: pd.register_host_tensor(w.cpu, DEV, policy=v),  # type: ignore[arg-type]
    "register_host_tensor:shared": lambda w, v: pd.register_host_tensor(w.cpu, DEV, shared=v),  # type: ignore[arg-type]
    "HostKVPool.__init__:numa": lambda w, v: pd.HostKVPool(w.host_layout, DEV, numa=v),  # type: ignore[arg-type]
    "HostKVPool.__init__:policy": lambda w, v: pd.HostKVPool(w.host_layout, DEV, policy=v),  # type: ignore[arg-type]
    "HostKVPool.__init__:layout": lambda w, v: pd.HostKVPool(v, DEV),  # type: ignore[arg-type]
    "DeviceKVPool.__init__:layout": lambda w, v: pd.DeviceKVPool(v, DEV),  # type: ignore[arg-type]
    "HostKVPool.backup:device_pool": lambda w, v: w.host.backup(v, w.idx, w.idx),  # type: ignore[arg-type]
    "HostKVPool.load:device_pool": lambda w, v: w.host.load(v, w.idx, w.idx),  # type: ignore[arg-type]
    "HostKVPool.load_layer:device_pool": lambda w, v: w.host.load_layer(v, w.idx, w.idx, 0),  # type: ignore[arg-type]
    "memory_device:whole_storage": lambda w, v: pd.memory_device(w.cpu, whole_storage=v),  # type: ignore[arg-type]
    "strict_alias.__init__:enabled": lambda w, v: pd.strict_alias(v),  # type: ignore[arg-type]
    "make_kernel_ptr_table:layout": lambda w, v: pd.make_kernel_ptr_table(w.device.buffers, DEV, layout=v),  # type: ignore[arg-type]
    "page_buffer_meta:layout": lambda w, v: pd.page_buffer_meta(w.host.host_table, v, [0]),  # type: ignore[arg-type]
    "make_kernel_ptr_table:host_memory_registered":
        lambda w, v: sglang.make_kernel_ptr_table(w.device.buffers, DEV, host_memory_registered=v),  # type: ignore[arg-type]
    "sglang_host_shape:layout": lambda w, v: sglang.sglang_host_shape(v),  # type: ignore[arg-type]
    "HostKVCacheAdapter.__init__:layout":
        lambda w, v: sglang.HostKVCacheAdapter(w.host.buffer, v, DEV),  # type: ignore[arg-type]
    "HostKVCacheAdapter.from_pool:pool": lambda w, v: sglang.HostKVCacheAdapter.from_pool(v),  # type: ignore[arg-type]
    "HostNixlAgent.register_pool:pool": lambda w, v: nixl.HostNixlAgent("a", agent=object()).register_pool(v),  # type: ignore[arg-type]
    "HostTransferEngine.register_pool:pool":
        lambda w, v: mooncake.HostTransferEngine(object(), "h").register_pool(v),  # type: ignore[arg-type]
    "RegisteredHostMemory.quarantine:stage": lambda w, v: w.host.memory.quarantine(v, "sample"),  # type: ignore[arg-type]
    "HostNixlAgent.transfer:op": lambda w, v: nixl.HostNixlAgent("a", agent=object()).transfer(v, [], [], "p"),  # type: ignore[arg-type]
    "PagedKVConnector.__init__:pointer_cache": lambda w, v: lmcache.PagedKVConnector(pointer_cache=v),  # type: ignore[arg-type]
    "run_batch_copy:batch": lambda w, v: vllm.run_batch_copy(v, lambda *a: None),  # type: ignore[arg-type]
    "swap_blocks_batch:is_src_access_order_any":
        lambda w, v: compat_vllm.swap_blocks_batch(w.idx, w.idx, w.idx, v),  # type: ignore[arg-type]
    "single_layer_kv_transfer:token_major":
        lambda w, v: compat_lmcache.single_layer_kv_transfer(w.cpu, w.cpu, w.idx, 0, 1, v),  # type: ignore[arg-type]
    "kernel_op:table_tensor": lambda w, v: wrap.kernel_op(lambda: None, table_tensor=v),  # type: ignore[arg-type]
}
for _per_layer, _name in ((False, "transfer_kv_all_layer"), (True, "transfer_kv_per_layer")):
    for _param in ("backend", "validate_indices", "max_ctas", "src_layout", "dst_layout"):
        def _sample(w: World, v: object, per_layer: bool = _per_layer, param: str = _param) -> object:
            if param in ("src_layout", "dst_layout"):
                fn: Any = pd.transfer_kv_per_layer if per_layer else pd.transfer_kv_all_layer
                layouts: dict[str, object] = {"src_layout": w.host_layout, "dst_layout": w.layout, param: v}
                extra: dict[str, object] = {"layer_id": 0} if per_layer else {}
                return fn(w.host.kernel_table, w.device.table, w.idx, w.idx, **layouts, **extra)
            return _transfer(per_layer, **{param: v})(w)
        SAMPLES[f"{_name}:{_param}"] = _sample
for _param in ("backend", "validate_indices", "max_ctas", "src_layout", "dst_layout"):
    def _explain_sample(w: World, v: object, param: str = _param) -> object:
        kw: dict[str, object] = {"src_layout": w.host_layout, "dst_layout": w.layout, param: v}
        return pd.explain_transfer(w.host.kernel_table, w.device.table, w.idx, w.idx, **kw)
    SAMPLES[f"explain_transfer:{_param}"] = _explain_sample
for _param in ("backend", "validate_indices", "max_ctas", "src_layout", "dst_layout"):
    def _layers_sample(w: World, v: object, param: str = _param) -> object:
        kw: dict[str, object] = {"src_layout": w.host_layout, "dst_layout": w.layout, param: v}
        return pd.load_layers(w.host.kernel_table, w.device.table, w.idx, w.idx, **kw)  # type: ignore[arg-type]
    SAMPLES[f"load_layers:{_param}"] = _layers_sample
SAMPLES["HostKVPool.load_layers:device_pool"] = lambda w, v: w.host.load_layers(v, w.idx, w.idx)  # type: ignore[arg-type]
for _method in ("backup", "load", "load_layer", "load_layers"):
    for _param in ("backend", "validate_indices", "max_ctas"):
        def _pool_sample(w: World, v: object, method: str = _method, param: str = _param) -> object:
            args: tuple[object, ...] = (w.device, w.idx, w.idx) + ((0,) if method == "load_layer" else ())
            return getattr(w.host, method)(*args, **{param: v})
        SAMPLES[f"HostKVPool.{_method}:{_param}"] = _pool_sample
for _method in ("backup_from_device_all_layer", "load_to_device_all_layer", "load_to_device_per_layer"):
    def _adapter_sample(w: World, v: object, method: str = _method) -> object:
        adapter = sglang.HostKVCacheAdapter.from_pool(w.host)
        args: tuple[object, ...] = (w.device, w.idx, w.idx) + ((0,) if method == "load_to_device_per_layer" else ())
        return getattr(adapter, method)(*args, max_ctas=v)
    SAMPLES[f"HostKVCacheAdapter.{_method}:max_ctas"] = _adapter_sample
for _method in ("from_gpu", "to_gpu"):
    def _connector_sample(w: World, v: object, method: str = _method) -> object:
        return getattr(lmcache.PagedKVConnector(), method)(
            w.host.memory.tensor[:768], 0, 4, kvcaches=w.device.buffers, slot_mapping=w.idx, device=DEV, max_ctas=v)
    SAMPLES[f"PagedKVConnector.{_method}:max_ctas"] = _connector_sample


def _hint(key: str) -> object:
    qualname, param = key.split(":")
    for module in _public_modules():
        for name, fn in _functions(module):
            if name == qualname and param in inspect.signature(fn).parameters:
                return typing.get_type_hints(fn)[param]
    raise AssertionError(f"{key}: not found")


def wrong_values(tp: object) -> list[object]:
    """Values a caller could pass by mistake that the type does not allow."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    allowed_none = type(None) in args
    values: list[object] = []
    literals = [v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
    strings = [v for v in literals if isinstance(v, str)]
    if strings:
        values += [strings[0].upper() + "_", strings[0] + "s"]
    if bool in args or True in literals:
        values += ["no", 1]
    if any(isinstance(a, type) and a.__module__.startswith("pointerdomain") and a is not bool for a in args):
        values += ["degrade", object()]
    if not strings and bool not in args:
        values.append("x")
    if not allowed_none:
        values.append(None)
    ints_allowed = int in args
    return [v for v in values if not (ints_allowed and type(v) is int)]


def test_every_checked_parameter_has_a_sample_call() -> None:
    missing = sorted(discovered() - set(SAMPLES) - set(EXEMPT))
    assert not missing, f"public parameters without a run-time check sample: {missing}"
    stale = sorted((set(SAMPLES) | set(EXEMPT)) - discovered())
    assert not stale, f"samples for parameters that no longer exist: {stale}"


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.host.close()


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_wrong_value_is_a_typed_error_naming_the_parameter(key: str, world: World) -> None:
    param = key.split(":")[1]
    pinned = pd.registration.memory.pinned_bytes()
    for value in wrong_values(_hint(key)):
        with pytest.raises(errors.PointerDomainError) as info:
            SAMPLES[key](world, value)
        assert param in str(info.value), f"{key}={value!r}: {info.value}"
        assert pd.registration.memory.pinned_bytes() == pinned, f"{key}={value!r} registered memory"
