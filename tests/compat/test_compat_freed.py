"""A cached compat call whose raw tables name device memory freed since (or an address
reused by a smaller allocation) is refused with a typed error before anything is written,
as the first, uncached call over that memory is. Each case runs in a child process: a
launch into freed memory would end the process (SIGSEGV) rather than fail an assert."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
