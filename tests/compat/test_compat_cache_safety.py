"""What a compat call writes is always live memory it may write: a cached call whose raw
tables name device memory freed since (or an address reused by a smaller allocation) is
refused with a typed error before anything is written, as the first, uncached call is; and
a destination naming one buffer twice is refused (OverlapError). The freed-memory cases run
in a child process: a launch into freed memory would end the process (SIGSEGV) rather than
fail an assert."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import pointerdomain as pd
from pointerdomain.compat import sgl_kernel as sk
from pointerdomain.errors import OverlapError

_PRELUDE = """
import gc, torch, pointerdomain as pd
from pointerdomain.compat import sgl_kernel as sk, vllm
from pointerdomain.errors import ClosedError, IndexValidationError, NotRegisteredError, RegistrationSpanError
dev = pd.validate_device("emulated:0")
L, T, ITEM = 2, 4096, 32
def buf(): return pd.device_empty((T, ITEM // 2), dtype=torch.bfloat16, device=dev).fill_(0)
def table(ts): return pd.device_empty((len(ts),), dtype=torch.uint64, device=dev).copy_(
    torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64))
I = lambda *v: torch.tensor(v, dtype=torch.int64)
def refused(call, *types):
    try:
        call()
    except types as exc:
        print("REFUSED", type(exc).__name__)
        return
    raise SystemExit("accepted")
"""

_CASES = {
    "all_layer_mla": """
src = [buf().fill_(1) for _ in range(L)]; dst = [buf() for _ in range(L)]
ts, td = table(src), table(dst)
sk.transfer_kv_all_layer_mla(ts, td, I(0), I(200), ITEM, L)
assert all(bool((d[200] == 1).all()) for d in dst)
del dst[0]; gc.collect()
refused(lambda: sk.transfer_kv_all_layer_mla(ts, td, I(0), I(200), ITEM, L), NotRegisteredError, ClosedError)
refused(lambda: sk.transfer_kv_all_layer_mla(ts, td, I(1), I(201), ITEM, L), NotRegisteredError, ClosedError)
""",
    "all_layer_mla_same_indices_objects": """
src = [buf().fill_(1) for _ in range(L)]; dst = [buf() for _ in range(L)]
ts, td = table(src), table(dst)
s, d = I(0), I(200)
for _ in range(3):
    sk.transfer_kv_all_layer_mla(ts, td, s, d, ITEM, L)
del dst[1]; gc.collect()
refused(lambda: sk.transfer_kv_all_layer_mla(ts, td, s, d, ITEM, L), NotRegisteredError, ClosedError)
""",
    "smaller_reuse": """
def slots16(): return pd.device_empty((16 * ITEM,), dtype=torch.uint8, device=dev).fill_(0)
src = [slots16().fill_(1) for _ in range(L)]; dst = [slots16() for _ in range(L)]
ts, td = table(src), table(dst)
sk.transfer_kv_all_layer_mla(ts, td, I(0), I(15), ITEM, L)
assert all(bool((d[15 * ITEM:] == 1).all()) for d in dst)
addr = dst[0].data_ptr()
del dst[0]; gc.collect()
small = pd.device_empty((4 * ITEM,), dtype=torch.uint8, device=dev).fill_(7)  # 4 slots where there were 16
if small.data_ptr() != addr:
    print("REFUSED skip: the address was not reused")
    raise SystemExit(0)
print("reused")
refused(lambda: sk.transfer_kv_all_layer_mla(ts, td, I(0), I(15), ITEM, L),
        NotRegisteredError, ClosedError, RegistrationSpanError, IndexValidationError)  # 4 slots now
assert bool((small == 7).all())
""",
    "swap_blocks_batch_host_src": """
host = pd.alloc_registered(512, dev)
src = host.tensor[:512].view(2, 256); src.fill_(3)
dst = pd.device_empty((2, 256), dtype=torch.uint8, device=dev).fill_(0)
ptrs = (torch.tensor([src[0].data_ptr(), src[1].data_ptr()]), torch.tensor([dst[1].data_ptr(), dst[0].data_ptr()]),
        torch.tensor([256, 256]))
vllm.swap_blocks_batch(*ptrs)
assert bool((dst == 3).all())
del dst; gc.collect()
refused(lambda: vllm.swap_blocks_batch(*ptrs), NotRegisteredError, ClosedError)
""",
    "swap_blocks_batch": """
src = pd.device_empty((2, 256), dtype=torch.uint8, device=dev).fill_(3)
dst = pd.device_empty((2, 256), dtype=torch.uint8, device=dev).fill_(0)
ptrs = (torch.tensor([src[0].data_ptr(), src[1].data_ptr()]), torch.tensor([dst[1].data_ptr(), dst[0].data_ptr()]),
        torch.tensor([256, 256]))
vllm.swap_blocks_batch(*ptrs)
assert bool((dst == 3).all())
del dst; gc.collect()
refused(lambda: vllm.swap_blocks_batch(*ptrs), NotRegisteredError, ClosedError)
""",
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_a_cached_call_over_freed_device_memory_is_refused(case: str) -> None:
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(_CASES[case])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stdout[-2000:]}{run.stderr[-2000:]}"
    assert "REFUSED" in run.stdout


# -- one destination buffer named twice ---------------------------------------------------

DEV = pd.Device("emulated", 0)
ITEM = 32


def _buf(slots: int = 64, fill: int = 0) -> torch.Tensor:
    return pd.device_empty((slots * ITEM,), dtype=torch.uint8, device=DEV).fill_(fill)


def _table(ptrs: list[int]) -> torch.Tensor:
    return pd.device_empty((len(ptrs),), dtype=torch.uint64, device=DEV).copy_(torch.tensor(ptrs, dtype=torch.uint64))


def _idx(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


@pytest.mark.parametrize("offset", [0, 16], ids=["same_buffer", "overlapping_ranges"])
def test_a_raw_destination_table_naming_one_buffer_twice_is_refused(offset: int) -> None:
    a, b, c = _buf(fill=1), _buf(fill=2), _buf()
    before = c.clone()
    with pytest.raises(OverlapError):
        sk.transfer_kv_all_layer_mla(_table([a.data_ptr(), b.data_ptr()]), _table([c.data_ptr(), c.data_ptr() + offset]),
                                     _idx(0), _idx(1), ITEM, 2)
    assert torch.equal(c, before)


def test_a_cached_destination_table_rewritten_to_name_one_buffer_twice_is_refused() -> None:
    a, b, c, d = _buf(fill=1), _buf(fill=2), _buf(), _buf()
    ts, td = _table([a.data_ptr(), b.data_ptr()]), _table([c.data_ptr(), d.data_ptr()])
    for _ in range(2):  # the second call is a cached one
        sk.transfer_kv_all_layer_mla(ts, td, _idx(0), _idx(1), ITEM, 2)
    assert torch.equal(c[ITEM:2 * ITEM], a[:ITEM]) and torch.equal(d[ITEM:2 * ITEM], b[:ITEM])
    td.copy_(torch.tensor([c.data_ptr(), c.data_ptr()], dtype=torch.uint64))
    c.fill_(0)
    before = c.clone()
    with pytest.raises(OverlapError):
        sk.transfer_kv_all_layer_mla(ts, td, _idx(0), _idx(1), ITEM, 2)
    assert torch.equal(c, before)


def test_a_destination_slot_past_the_next_entry_is_refused() -> None:
    # two layers in one allocation, 8 slots apart: slot 8 of layer 0 is slot 0 of layer 1
    a, b = _buf(fill=1), _buf(fill=2)
    c = _buf(slots=64)
    before = c.clone()
    td = _table([c.data_ptr(), c.data_ptr() + 8 * ITEM])
    with pytest.raises(IndexError):
        sk.transfer_kv_all_layer_mla(_table([a.data_ptr(), b.data_ptr()]), td, _idx(0), _idx(8), ITEM, 2)
    assert torch.equal(c, before)
    sk.transfer_kv_all_layer_mla(_table([a.data_ptr(), b.data_ptr()]), td, _idx(0), _idx(7), ITEM, 2)
    assert torch.equal(c[7 * ITEM:8 * ITEM], a[:ITEM]) and torch.equal(c[15 * ITEM:16 * ITEM], b[:ITEM])


def test_a_tensor_destination_list_naming_one_buffer_twice_is_refused() -> None:
    src_k, src_v, dst = _buf(fill=1).view(-1, ITEM), _buf(fill=2).view(-1, ITEM), _buf().view(-1, ITEM)
    before = dst.clone()
    with pytest.raises(OverlapError):
        sk.transfer_kv_per_layer(src_k, dst, src_v, dst, _idx(0), _idx(1), ITEM)
    assert torch.equal(dst, before)

