"""kernel_op: a raw-pointer-table op behind a typed stub, on the emulated device (device
aliases differ from host VAs there). The "third-party ops" here copy bytes with
ctypes.memmove through the uint64 entries they are handed, trusting them as a kernel
would; expected bytes come from plain torch indexing, destinations are poisoned first."""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Iterator

import pytest
import torch

import pointerdomain as pd
from pointerdomain import DeviceAlias, HostVA, PointerTable, errors
from pointerdomain.compat.wrap import KernelOp, cached_table_tensor, kernel_op

DEV = "emulated:0"
POISON = 0xA5
LAYERS, SLOTS, ITEM = 3, 8, 16  # ITEM: bytes per slot


class Recorder:
    """A stand-in for ``torch.ops.sgl_kernel.transfer_kv_all_layer.default``: the same ten
    positional arguments, no defaults (as a torch.ops overload); copies ``item_size``
    bytes per (layer, index pair) for K and V through the raw entries."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def __call__(self, src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor, dst_v: torch.Tensor,
                 src_idx: torch.Tensor, dst_idx: torch.Tensor, item_size: int, num_layers: int,
                 block_quota: int, num_warps_per_block: int) -> None:
        self.calls.append((src_k, dst_k, src_v, dst_v, src_idx, dst_idx, item_size, num_layers, block_quota,
                           num_warps_per_block))
        for tables in ((src_k, dst_k), (src_v, dst_v)):
            for t in tables:
                assert t.dtype == torch.uint64 and t.dim() == 1
            for s_base, d_base in list(zip(tables[0].tolist(), tables[1].tolist()))[:num_layers]:
                for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
                    ctypes.memmove(d_base + d * item_size, s_base + s * item_size, item_size)


def wrap(op: Recorder, **kw: object) -> KernelOp[..., None]:
    @kernel_op(op, **kw)  # type: ignore[arg-type]
    def transfer_kv_all_layer(
        src_k_layers: PointerTable[DeviceAlias], dst_k_layers: PointerTable[DeviceAlias],
        src_v_layers: PointerTable[DeviceAlias], dst_v_layers: PointerTable[DeviceAlias],
        src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int, num_layers: int,
        block_quota: int = 2, num_warps_per_block: int = 32,
    ) -> None: ...

    return transfer_kv_all_layer


def device_layers(seed: int, device: str = DEV) -> list[torch.Tensor]:
    out = []
    for i in range(LAYERS):
        t = pd.device_empty((SLOTS, ITEM), torch.uint8, device)
        t.copy_(torch.randint(0, 256, (SLOTS, ITEM), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + i)))
        out.append(t)
    return out


@pytest.fixture
def host() -> Iterator[tuple[pd.RegisteredHostMemory, torch.Tensor]]:
    """Registered host memory as sglang's host pool keeps it: ``[2, layers, slots, item]``, poisoned."""
    mem = pd.alloc_registered(2 * LAYERS * SLOTS * ITEM, DEV)
    buf = mem.tensor.view(2, LAYERS, SLOTS, ITEM)
    buf.fill_(POISON)
    yield mem, buf
    if not mem.closed:
        mem.close()


def tables(layers: list[torch.Tensor]) -> PointerTable[DeviceAlias]:
    return pd.make_kernel_ptr_table(layers, DEV)


def check_backup(buf: torch.Tensor, dk: list[torch.Tensor], dv: list[torch.Tensor],
                 src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst slots hold the device items of src slots; every other host byte is still poison."""
    expected = torch.full_like(buf, POISON)
    for layer in range(LAYERS):
        expected[0, layer][dst] = dk[layer][src]
        expected[1, layer][dst] = dv[layer][src]
    assert torch.equal(buf, expected)


def test_the_op_gets_aliases_and_moves_exact_bytes(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    dk, dv = device_layers(1), device_layers(10)
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    fn = wrap(op)
    src, dst = torch.tensor([1, 6, 3]), torch.tensor([0, 7, 2])
    fn(tables(dk), hk, tables(dv), hv, src, dst, ITEM, LAYERS)
    check_backup(buf, dk, dv, src, dst)

    (call,) = op.calls
    # the host tables reached the op as their device aliases, which differ from the host VAs
    got = call[1]
    assert isinstance(got, torch.Tensor)
    assert got.tolist() == list(hk.raw_values())
    assert got.tolist() == [pd.resolve_alias(HostVA(buf[0, i].data_ptr()), DEV).value for i in range(LAYERS)]
    assert all(a != buf[0, i].data_ptr() for i, a in enumerate(got.tolist()))
    assert pd.memory_device(got) == pd.Device("emulated", 0)
    # the stub's defaults were filled in for the op, which has none
    assert call[6:] == (ITEM, LAYERS, 2, 32)


def test_keyword_and_positional_calls_reach_the_op_alike(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    dk, dv = tables(device_layers(1)), tables(device_layers(10))
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    fn = wrap(op)
    idx = torch.tensor([0])
    fn(dk, hk, dv, hv, idx, idx, ITEM, LAYERS, 4, 8)
    fn(src_k_layers=dk, dst_k_layers=hk, src_v_layers=dv, dst_v_layers=hv, src_indices=idx, dst_indices=idx,
       item_size=ITEM, num_layers=LAYERS, num_warps_per_block=8, block_quota=4)
    fn(dk, hk, dv, hv, idx, idx, num_layers=LAYERS, item_size=ITEM, block_quota=4, num_warps_per_block=8)
    first = op.calls[0]
    for call in op.calls[1:]:
        assert len(call) == len(first)
        for a, b in zip(call, first):
            assert a is b or a == b


def test_signature_is_the_stubs() -> None:
    fn = wrap(Recorder())
    assert list(inspect.signature(fn).parameters) == [
        "src_k_layers", "dst_k_layers", "src_v_layers", "dst_v_layers", "src_indices", "dst_indices", "item_size",
        "num_layers", "block_quota", "num_warps_per_block"]
    assert fn.tables == ("src_k_layers", "dst_k_layers", "src_v_layers", "dst_v_layers")
    assert fn.__name__ == "transfer_kv_all_layer"


@pytest.mark.parametrize("bad", ["raw_tensor", "host_table", "list", "none"])
def test_a_table_parameter_takes_only_a_kernel_table(
        bad: str, host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    dk, dv = tables(device_layers(1)), tables(device_layers(10))
    host_layers = [buf[1, i] for i in range(LAYERS)]
    hk = tables([buf[0, i] for i in range(LAYERS)])
    wrong: object = {
        # what sglang builds today: data_ptr() of host memory, handed to the kernel as is
        "raw_tensor": torch.tensor([t.data_ptr() for t in host_layers], dtype=torch.uint64),
        "host_table": pd.host_ptr_table(host_layers),
        "list": host_layers,
        "none": None,
    }[bad]
    op = Recorder()
    with pytest.raises(errors.DomainError, match="dst_v_layers") as info:
        wrap(op)(dk, hk, dv, wrong, torch.tensor([0]), torch.tensor([0]), ITEM, LAYERS)
    assert "PointerTable[DeviceAlias]" in str(info.value)
    if bad == "host_table":
        assert "PointerTable[HostVA]" in str(info.value)
    assert op.calls == [] and bool((buf == POISON).all())


def test_tables_on_two_devices(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    other = pd.make_kernel_ptr_table(device_layers(1, "emulated:1"), "emulated:1")
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    with pytest.raises(errors.DeviceMismatchError, match="src_v_layers.*emulated:1.*src_k_layers"):
        wrap(op)(tables(device_layers(1)), hk, other, hv, torch.tensor([0]), torch.tensor([0]), ITEM, LAYERS)
    assert op.calls == [] and bool((buf == POISON).all())


def test_closed_registration_and_released_storage(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    mem, buf = host
    dk, dv = tables(device_layers(1)), tables(device_layers(10))
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    fn = wrap(op)
    idx = torch.tensor([0])
    fn(dk, hk, dv, hv, idx, idx, ITEM, LAYERS)  # works (and caches the copies) while all is live
    assert len(op.calls) == 1

    # a registered host buffer whose storage is released under its table
    other = torch.full((LAYERS * SLOTS * ITEM,), POISON, dtype=torch.uint8)
    with pd.register_host_tensor(other, DEV):
        ov = tables(list(other.view(LAYERS, SLOTS, ITEM).unbind(0)))
        fn(dk, hk, dv, ov, idx, idx, ITEM, LAYERS)
        assert len(op.calls) == 2
        other.untyped_storage().resize_(0)
        with pytest.raises(errors.ClosedError, match="storage of an entry changed"):
            fn(dk, hk, dv, ov, idx, idx, ITEM, LAYERS)

    before = buf.clone()
    mem.close()  # the host pool's registration closed under its tables (cached copies and all)
    with pytest.raises(errors.ClosedError):
        fn(dk, hk, dv, hv, idx, idx, ITEM, LAYERS)
    assert len(op.calls) == 2
    assert torch.equal(buf, before)


def test_cached_copy_is_reused_and_private(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    dk, dv = tables(device_layers(1)), tables(device_layers(10))
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    idx = torch.tensor([0])
    op = Recorder()
    fn = wrap(op)
    fn(dk, hk, dv, hv, idx, idx, ITEM, LAYERS)
    fn(dk, hk, dv, hv, idx, idx, ITEM, LAYERS)
    a, b = op.calls
    assert all(x is y for x, y in zip(a[:4], b[:4]))  # no new tensor per call
    # an op writing its table through torch: the next call gets a fresh, right copy and the
    # table's own array (what its launches read) never changed
    got = a[1]
    assert isinstance(got, torch.Tensor)
    got.fill_(0)
    fn(dk, hk, dv, hv, idx, idx, ITEM, LAYERS)
    c = op.calls[2][1]
    assert isinstance(c, torch.Tensor)
    assert c is not got and c.tolist() == list(hk.raw_values())
    assert hk.as_uint64_tensor().tolist() == list(hk.raw_values())


def test_copy_mode_hands_a_new_tensor_each_call(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    dk, dv = tables(device_layers(1)), tables(device_layers(10))
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    fn = wrap(op, table_tensor="copy")
    src, dst = torch.tensor([2, 5]), torch.tensor([4, 1])
    fn(dk, hk, dv, hv, src, dst, ITEM, LAYERS)
    fn(dk, hk, dv, hv, src, dst, ITEM, LAYERS)
    a, b = op.calls
    assert all(x is not y for x, y in zip(a[:4], b[:4]))
    assert isinstance(a[1], torch.Tensor) and a[1].tolist() == list(hk.raw_values())


def test_call_shape_errors() -> None:
    op = Recorder()
    fn = wrap(op)
    t = tables(device_layers(1))
    idx = torch.tensor([0])
    with pytest.raises(errors.InvalidTypeError, match="dst_v_layers"):
        fn(t, t, t, src_indices=idx, dst_indices=idx, item_size=ITEM, num_layers=LAYERS)  # a table missing
    with pytest.raises(errors.InvalidTypeError, match="unexpected keyword"):
        fn(t, t, t, t, idx, idx, ITEM, LAYERS, stream=0)
    with pytest.raises(errors.InvalidTypeError, match="too many positional"):
        fn(t, t, t, t, idx, idx, ITEM, LAYERS, 2, 32, 0)
    with pytest.raises(errors.InvalidTypeError, match="multiple values"):
        fn(t, t, t, t, idx, idx, ITEM, LAYERS, item_size=ITEM)
    assert op.calls == []


def test_keyword_only_positional_only_and_var_keyword(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    got: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def op(*args: object, **kwargs: object) -> int:
        got.append((args, kwargs))
        return 7

    @kernel_op(op)
    def mla(src: PointerTable[DeviceAlias], /, n: int, *, dst: PointerTable[DeviceAlias], **extra: object) -> int:
        raise NotImplementedError

    dev = tables(device_layers(1))
    hk = tables([buf[0, i] for i in range(LAYERS)])
    assert mla.tables == ("src", "dst")
    assert mla(dev, 3, dst=hk, flag=True) == 7
    ((args, kwargs),) = got
    assert isinstance(args[0], torch.Tensor) and args[0].tolist() == list(dev.raw_values()) and args[1] == 3
    dst = kwargs.pop("dst")
    assert isinstance(dst, torch.Tensor) and dst.tolist() == list(hk.raw_values()) and kwargs == {"flag": True}
    with pytest.raises(errors.InvalidTypeError):
        mla(3, src=dev, dst=hk)  # type: ignore[call-arg, arg-type]  # positional-only given by name
    with pytest.raises(errors.InvalidTypeError, match="multiple values"):
        mla(dev, 3, n=3, dst=hk)  # type: ignore[misc]
    with pytest.raises(errors.DomainError, match="dst"):
        mla(dev, 3, dst=pd.host_ptr_table([buf[0, 0]]))  # type: ignore[arg-type]
    assert len(got) == 1


@torch.library.custom_op("pointerdomain_wrap_test::copy_items", mutates_args=())
def _copy_items_impl(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                     item_size: int) -> None:
    """A dispatcher op with a schema (as torch.ops.sgl_kernel's) that trusts its pointer tables."""
    for s_base, d_base in zip(src_ptrs.tolist(), dst_ptrs.tolist()):
        for s, d in zip(src_idx.tolist(), dst_idx.tolist()):
            ctypes.memmove(d_base + d * item_size, s_base + s * item_size, item_size)


@torch.library.custom_op("pointerdomain_wrap_test::touch_ptrs", mutates_args=("ptrs",))
def _touch_ptrs_impl(ptrs: torch.Tensor, seen: torch.Tensor) -> None:
    """An op whose schema says it writes its table (it does not): records what it got."""
    seen.copy_(ptrs)


def test_an_op_marked_mutable_gets_a_fresh_copy_each_call() -> None:
    @kernel_op(torch.ops.pointerdomain_wrap_test.touch_ptrs.default)
    def touch(ptrs: PointerTable[DeviceAlias], seen: torch.Tensor) -> None: ...

    table = tables(device_layers(3))
    seen = torch.zeros(LAYERS, dtype=torch.uint64)
    first = cached_table_tensor("touch", "ptrs", table)
    touch(table, seen)
    assert seen.tolist() == list(table.raw_values())
    # the dispatcher bumped the version of the argument it was told is written: a new copy next time
    assert cached_table_tensor("touch", "ptrs", table) is not first
    seen.zero_()
    touch(table, seen)
    assert seen.tolist() == list(table.raw_values())


def test_a_real_torch_op(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    """Through torch's dispatcher: torch.ops.<ns>.<op>.default, as sglang calls its kernels."""
    _, buf = host
    raw_op = torch.ops.pointerdomain_wrap_test.copy_items.default

    @kernel_op(raw_op, tables=("src_ptrs", "dst_ptrs"))
    def copy_items(src_ptrs: PointerTable[DeviceAlias], dst_ptrs: PointerTable[DeviceAlias],
                   src_idx: torch.Tensor, dst_idx: torch.Tensor, item_size: int) -> None: ...

    dk = device_layers(5)
    src, dst = torch.tensor([7, 0]), torch.tensor([3, 4])
    copy_items(tables(dk), tables([buf[0, i] for i in range(LAYERS)]), src, dst, ITEM)
    expected = torch.full_like(buf, POISON)
    for layer in range(LAYERS):
        expected[0, layer][dst] = dk[layer][src]
    assert torch.equal(buf, expected)
    with pytest.raises(errors.DomainError, match="dst_ptrs"):
        copy_items(tables(dk), torch.tensor([buf[0, 0].data_ptr()], dtype=torch.uint64),  # type: ignore[arg-type]
                   src, dst, ITEM)
    assert torch.equal(buf, expected)


# --------------------------------------------------------------------------- decoration errors


def op_stub(*args: object) -> None:
    del args


def test_decoration_refuses_names_and_annotations_that_do_not_fit() -> None:
    def stub(src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias], n: int) -> None: ...

    with pytest.raises(errors.InvalidArgumentError, match="'dts'.*not a parameter"):
        kernel_op(op_stub, tables=("src", "dts"))(stub)
    with pytest.raises(errors.InvalidArgumentError, match="'n'.*PointerTable\\[DeviceAlias\\]"):
        kernel_op(op_stub, tables=("src", "dst", "n"))(stub)
    with pytest.raises(errors.InvalidArgumentError, match="'dst'.*not in tables"):
        kernel_op(op_stub, tables=("src",))(stub)
    with pytest.raises(errors.InvalidArgumentError, match="twice"):
        kernel_op(op_stub, tables=("src", "src"))
    with pytest.raises(errors.InvalidArgumentError, match="empty"):
        kernel_op(op_stub, tables=())
    with pytest.raises(errors.InvalidTypeError, match="sequence of parameter names"):
        kernel_op(op_stub, tables="src")
    with pytest.raises(errors.InvalidTypeError, match="parameter names"):
        kernel_op(op_stub, tables=("src", 1))  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidTypeError, match="callable"):
        kernel_op(42, tables=("src",))  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="table_tensor"):
        kernel_op(op_stub, table_tensor="view")  # type: ignore[arg-type]


def test_decoration_refuses_host_tables_raw_tensors_defaults_and_varargs() -> None:
    def host_stub(src: PointerTable[DeviceAlias], dst: PointerTable[HostVA]) -> None: ...

    def raw_stub(src: PointerTable[DeviceAlias], dst: torch.Tensor) -> None: ...

    def optional_stub(src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias] | None = None) -> None: ...

    def default_stub(src: PointerTable[DeviceAlias], dst: PointerTable[DeviceAlias] = None) -> None: ...  # type: ignore[assignment]

    def var_stub(src: PointerTable[DeviceAlias], *dst: PointerTable[DeviceAlias]) -> None: ...

    def no_table(src: torch.Tensor) -> None: ...

    with pytest.raises(errors.InvalidArgumentError, match="'dst'.*host table"):
        kernel_op(op_stub)(host_stub)
    with pytest.raises(errors.InvalidArgumentError, match="'dst'.*Tensor"):
        kernel_op(op_stub, tables=("src", "dst"))(raw_stub)
    with pytest.raises(errors.InvalidArgumentError, match="'dst'.*exactly"):
        kernel_op(op_stub, tables=("src", "dst"))(optional_stub)
    with pytest.raises(errors.InvalidArgumentError, match="'dst' has a default"):
        kernel_op(op_stub)(default_stub)
    with pytest.raises(errors.InvalidArgumentError, match=r"\*args"):
        kernel_op(op_stub, tables=("src", "dst"))(var_stub)
    with pytest.raises(errors.InvalidArgumentError, match="no parameter annotated"):
        kernel_op(op_stub)(no_table)
    with pytest.raises(errors.InvalidTypeError, match="expected a function"):
        kernel_op(op_stub)(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- what the op writes

#: sglang's transfer_kv_all_layer: slot i of every entry is item_size bytes at entry + i * item_size
SGLANG_SLOTS = {"src_k_layers": ("src_indices", "item_size"), "dst_k_layers": ("dst_indices", "item_size"),
                "src_v_layers": ("src_indices", "item_size"), "dst_v_layers": ("dst_indices", "item_size")}


def checked(op: Recorder) -> KernelOp[..., None]:
    return wrap(op, writes=("dst_k_layers", "dst_v_layers"), slots=SGLANG_SLOTS)


def test_declared_writes_move_exact_bytes_for_disjoint_slots(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    _, buf = host
    dk, dv = device_layers(1), device_layers(10)
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    fn = checked(op)
    src, dst = torch.tensor([1, 6, 3, 0]), torch.tensor([0, 7, 2, 5])
    for _ in range(2):  # the second call meets the tables again
        fn(tables(dk), hk, tables(dv), hv, src, dst, ITEM, LAYERS)
    check_backup(buf, dk, dv, src, dst)
    assert len(op.calls) == 2
    # one device buffer, slots moved inside it: entries are both read and written
    whole = device_layers(3)
    t = tables(whole)
    before = [x.clone() for x in whole]
    with pytest.raises(errors.OverlapError, match=r"dst_k_layers\[(\d)\] overlaps src_k_layers\[\1\]"):
        fn(t, t, tables(dv), hv, torch.tensor([0]), torch.tensor([1]), ITEM, LAYERS)
    assert all(torch.equal(a, b) for a, b in zip(whole, before))


@pytest.mark.parametrize(("src", "dst", "error", "match"), [
    ([0, 1, 2], [4, 7, 4], errors.OverlapError, r"dst_indices: slot 4 is given twice.*dst_k_layers"),
    ([0, 1], [3, SLOTS], errors.IndexValidationError, rf"dst_indices: slot {SLOTS} outside \[0, {SLOTS}\)"),
    ([0, 1], [-1, 2], errors.IndexValidationError, rf"dst_indices: slot -1 outside \[0, {SLOTS}\)"),
    ([0, SLOTS + 5], [1, 2], errors.IndexValidationError, rf"src_indices: slot {SLOTS + 5} outside"),
])
def test_declared_writes_refuse_bad_slots(host: tuple[pd.RegisteredHostMemory, torch.Tensor], src: list[int],
                                          dst: list[int], error: type[Exception], match: str) -> None:
    _, buf = host
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    s, d = torch.tensor(src), torch.tensor(dst)
    with pytest.raises(error, match=match):
        checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, s, d, ITEM, LAYERS)
    for where in ("emulated", "int32"):  # indices in emulated device memory; int32 indices
        if where == "emulated":
            s2, d2 = pd.device_empty(s.shape, torch.int64, DEV), pd.device_empty(d.shape, torch.int64, DEV)
            s2.copy_(s), d2.copy_(d)
        else:
            s2, d2 = s.to(torch.int32), d.to(torch.int32)
        with pytest.raises(error, match=match):
            checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, s2, d2, ITEM, LAYERS)
    assert op.calls == [] and bool((buf == POISON).all())


def test_declared_writes_refuse_an_item_size_past_the_entries(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    """item_size twice the real item: slot SLOTS // 2 would write past every host layer."""
    _, buf = host
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    with pytest.raises(errors.IndexValidationError, match=rf"dst_indices: slot {SLOTS // 2} outside \[0, {SLOTS // 2}\)"):
        checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, torch.tensor([0]),
                    torch.tensor([SLOTS // 2]), 2 * ITEM, LAYERS)
    for bad in (0, -ITEM, 1.5, True):
        with pytest.raises(errors.InvalidArgumentError, match="item_size"):
            checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, torch.tensor([0]),
                        torch.tensor([0]), bad, LAYERS)
    for idx in (torch.tensor([0.0]), torch.tensor([[0]]), torch.tensor([0, 1, 2, 3])[::2], [0]):
        with pytest.raises(errors.IndexValidationError, match="dst_indices"):
            checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, torch.tensor([0]), idx, ITEM,
                        LAYERS)
    assert op.calls == [] and bool((buf == POISON).all())


def test_declared_slots_refuse_released_index_storage(host: tuple[pd.RegisteredHostMemory, torch.Tensor]) -> None:
    """An index tensor whose storage was released (or shrunk under the view) is refused
    by name instead of reaching torch's untyped error or the op."""
    _, buf = host
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    released = torch.tensor([0])
    released.untyped_storage().resize_(0)
    shrunk = torch.tensor([0, 1, 2, 3])[2:]
    shrunk.untyped_storage().resize_(3 * 8)  # the view's last slot lies past the storage's end
    for idx in (released, shrunk):
        with pytest.raises(errors.IndexValidationError, match="dst_indices: .*storage"):
            checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, torch.tensor([1, 2])[:idx.numel()],
                        idx, ITEM, LAYERS)
        with pytest.raises(errors.IndexValidationError, match="src_indices: .*storage"):
            checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, idx,
                        torch.tensor([1, 2])[:idx.numel()], ITEM, LAYERS)
    assert op.calls == [] and bool((buf == POISON).all())


@pytest.mark.parametrize(("src", "dst"), [([0, 1, 2], [1]), ([0], [1, 2]), ([], [3])])
def test_declared_slots_refuse_index_tensors_of_different_lengths(
        host: tuple[pd.RegisteredHostMemory, torch.Tensor], src: list[int], dst: list[int]) -> None:
    """The op reads the index tensors as pairs: a shorter one would be read past its end."""
    _, buf = host
    hk, hv = tables([buf[0, i] for i in range(LAYERS)]), tables([buf[1, i] for i in range(LAYERS)])
    op = Recorder()
    s, d = torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
    match = rf"src_indices has {len(src)} slots and dst_indices {len(dst)}"
    with pytest.raises(errors.IndexValidationError, match=match):
        checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, s, d, ITEM, LAYERS)
    s2, d2 = pd.device_empty(s.shape, torch.int64, DEV), pd.device_empty(d.shape, torch.int64, DEV)
    s2.copy_(s), d2.copy_(d)
    with pytest.raises(errors.IndexValidationError, match=match):
        checked(op)(tables(device_layers(1)), hk, tables(device_layers(10)), hv, s2, d2, ITEM, LAYERS)
    assert op.calls == [] and bool((buf == POISON).all())


@pytest.mark.parametrize("shape", ["k_is_v", "v_one_slot_after_k", "two_layers_one_buffer", "dst_is_src"])
def test_declared_writes_refuse_destination_entries_that_share_memory(
        host: tuple[pd.RegisteredHostMemory, torch.Tensor], shape: str) -> None:
    mem, buf = host
    flat = buf.view(-1)
    layer_bytes = SLOTS * ITEM
    hk = tables([buf[0, i] for i in range(LAYERS)])
    dk, dv = tables(device_layers(1)), tables(device_layers(10))
    if shape == "k_is_v":
        src_k, dst_v, match = dk, hk, r"dst_k_layers\[0\] and dst_v_layers\[0\] share memory"
    elif shape == "v_one_slot_after_k":  # V's slot 0 is K's slot 1
        views = [flat[ITEM + 2 * i * layer_bytes: ITEM + (2 * i + 1) * layer_bytes] for i in range(LAYERS)]
        src_k, dst_v, match = dk, tables(views), r"dst_k_layers\[0\] and dst_v_layers\[0\] share memory"
    elif shape == "two_layers_one_buffer":
        src_k, dst_v = dk, tables([buf[1, 0], buf[1, 1], buf[1, 0]])
        match = r"dst_v_layers\[0\] and dst_v_layers\[2\] share memory"
    else:  # the host layers are read and written
        src_k, dst_v = hk, tables([buf[1, i] for i in range(LAYERS)])
        match = r"dst_k_layers\[(\d)\] overlaps src_k_layers\[\1\]"
    op = Recorder()
    with pytest.raises(errors.OverlapError, match=match):
        checked(op)(src_k, hk, dv, dst_v, torch.tensor([0, 1]), torch.tensor([2, 3]), ITEM, LAYERS)
    assert op.calls == [] and bool((buf == POISON).all())
    assert not mem.closed


def test_declared_writes_refused_at_decoration() -> None:
    op = Recorder()
    with pytest.raises(errors.InvalidArgumentError, match="writes names 'item_size'"):
        wrap(op, writes=("item_size",))
    with pytest.raises(errors.InvalidArgumentError, match="writes names 'nope'"):
        wrap(op, writes=("nope",))
    with pytest.raises(errors.InvalidTypeError, match="writes"):
        wrap(op, writes="dst_k_layers")
    with pytest.raises(errors.InvalidArgumentError, match="slots names 'src_indices'"):
        wrap(op, slots={"src_indices": ("src_indices", "item_size")})
    with pytest.raises(errors.InvalidArgumentError, match="'idx' is not a parameter"):
        wrap(op, slots={"src_k_layers": ("idx", "item_size")})
    with pytest.raises(errors.InvalidArgumentError, match="'dst_v_layers' is a table parameter"):
        wrap(op, slots={"src_k_layers": ("src_indices", "dst_v_layers")})
    with pytest.raises(errors.InvalidTypeError, match="slots"):
        wrap(op, slots={"src_k_layers": "src_indices"})
    fn = checked(op)
    assert fn.writes == ("dst_k_layers", "dst_v_layers") and fn.slots == SGLANG_SLOTS
    assert wrap(op).writes == () and wrap(op).slots == {}
