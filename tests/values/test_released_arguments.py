"""A tensor whose storage was released (``untyped_storage().resize_(0)``) passed where
an argument is checked: a typed error whose message describes the tensor by shape,
dtype and device. ``repr`` of such a tensor reads freed memory (a segfault), so each
call runs in a child process: a crash is reported, not the end of the test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pointerdomain.arguments import describe, storage_short
from tests.childenv import pythonpath

_CHILD = r"""
import json, sys, torch, pointerdomain as pd
from pointerdomain.compat import vllm, wrap
from pointerdomain.transfer.outcomes import run_spans
t = torch.zeros(16); t.untyped_storage().resize_(0)
idx = torch.arange(4)
dev = pd.validate_device("emulated:0")
calls = {
    "explain": lambda: pd.explain(t),
    "validate_device": lambda: pd.validate_device(t),
    "as_device": lambda: pd.as_device(t),
    "find_registration": lambda: pd.find_registration(t),
    "index_tensor name": lambda: pd.index_tensor(t, dev),
    "index_tensor ids": lambda: pd.index_tensor("ids", t),
    "synchronize": lambda: pd.synchronize(t),
    "check_errors": lambda: pd.check_errors(t),
    "external_stream device": lambda: pd.external_stream(t, None),
    "external_stream stream": lambda: pd.external_stream(dev, t),
    "host_ptr_table": lambda: pd.host_ptr_table([t]),
    "make_kernel_ptr_table": lambda: pd.make_kernel_ptr_table([t], dev),
    "page_buffer_meta layout": lambda: pd.page_buffer_meta(pd.host_ptr_table([torch.zeros(8)]), t, [0]),
    "RegistrationPolicy on_failure": lambda: pd.RegistrationPolicy(on_failure=t),
    "run_spans total": lambda: run_spans(t, [], lambda start, stop: None),
    "kernel_op table_tensor": lambda: wrap.kernel_op(lambda: None, table_tensor=t),
    "swap_blocks_batch order": lambda: vllm.swap_blocks_batch(idx, idx, idx, t),
}
name = sys.argv[1]
try:
    calls[name]()
    print(json.dumps({"raised": None}))
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "typed": isinstance(exc, pd.errors.PointerDomainError),
                      "message": str(exc)}))
"""

_CASES = {
    "explain": "InvalidArgumentError",
    "validate_device": "InvalidDeviceError",
    "as_device": "InvalidDeviceError",
    "find_registration": "DomainError",
    "index_tensor name": "InvalidTypeError",
    "index_tensor ids": "IndexValidationError",
    "synchronize": "InvalidDeviceError",
    "check_errors": "InvalidDeviceError",
    "external_stream device": "InvalidDeviceError",
    "external_stream stream": "InvalidArgumentError",
    "host_ptr_table": "ClosedError",
    "make_kernel_ptr_table": "ClosedError",
    "page_buffer_meta layout": "InvalidTypeError",
    "RegistrationPolicy on_failure": "InvalidRegistrationError",
    "run_spans total": "InvalidArgumentError",
    "kernel_op table_tensor": "InvalidArgumentError",
    "swap_blocks_batch order": "InvalidTypeError",
}

_DESCRIBED = "Tensor(shape=(16,), dtype=torch.float32, device=cpu, storage released)"


@pytest.mark.parametrize("call", sorted(_CASES))
def test_released_tensor_argument_gets_a_typed_error(call: str) -> None:
    child = subprocess.run([sys.executable, "-c", _CHILD, call], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=pythonpath()))
    assert child.returncode == 0, f"{call}: the child exited with {child.returncode}: {child.stderr[-2000:]}"
    got = json.loads(child.stdout.splitlines()[-1])
    assert got["raised"] == _CASES[call] and got["typed"], got
    assert _DESCRIBED in got["message"], got["message"]


def test_describe_never_reads_a_tensor() -> None:
    released = torch.zeros(16)
    released.untyped_storage().resize_(0)
    assert describe(released) == _DESCRIBED
    assert describe([released, 1]) == f"[{_DESCRIBED}, 1]"
    assert describe((released,)) == f"({_DESCRIBED},)"
    assert describe({"k": released}) == "{'k': " + _DESCRIBED + "}"
    live = torch.arange(6, dtype=torch.int64).view(2, 3)
    assert describe(live) == "Tensor(shape=(2, 3), dtype=torch.int64, device=cpu)"
    assert describe(list(range(10))) == "[0, 1, 2, 3, ...]"
    assert describe("x" * 200) == "'" + "x" * 76 + "..."
    assert describe(7) == "7" and describe(None) == "None"


def test_describe_survives_a_failing_repr() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert describe(Broken()) == "<Broken object>"


def test_storage_short() -> None:
    t = torch.zeros(16)
    assert not storage_short(t)
    assert not storage_short(t[4:])  # a view inside its storage
    assert not storage_short(torch.zeros(0))
    view = t[8:]
    t.untyped_storage().resize_(40)  # 10 floats: the view needs 16
    assert storage_short(view) and not storage_short(t[:10])
    t.untyped_storage().resize_(0)
    assert storage_short(t)
