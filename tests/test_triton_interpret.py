"""The Triton kernel of tests/test_triton_gpu.py under Triton's interpreter
(``TRITON_INTERPRET=1``, CPU): it loads the emulated device's aliases from the checked
tables (:func:`pointerdomain.transfer.triton.launch_args`) and must move exactly the addressed
items. On the emulated device the aliases differ from the host VAs, so a kernel given
host VAs for aliases would read other memory. Skipped, with the reason, without triton.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pointerdomain as pd

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""\
    import torch
    import triton
    import pointerdomain as pd
    from pointerdomain.transfer.triton import launch_args
    from tests.triton_pages import load_pages

    DEV = "emulated:0"
    dev_layout = pd.KVLayout(kind="layer_first", num_layers=3, num_pages=10, page_size=4, num_heads=4,
                             head_dim=64, dtype="bfloat16")
    host_layout = dev_layout.model_copy(update={"kind": "page_first", "num_pages": 8})
    device_pool = pd.DeviceKVPool(dev_layout, DEV)
    for t in device_pool.buffers:
        t.view(torch.uint8).fill_(0xA5)
    with pd.HostKVPool(host_layout, DEV) as host_pool:
        assert host_pool.kernel_table[0].value != host_pool.host_table[0].value
        flat = host_pool.buffer.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
        hs = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in (6, 1, 3)])
        ds = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in (0, 9, 4)])
        item = host_layout.item_bytes
        args, kwargs = launch_args(DEV, (host_pool.kernel_table, device_pool.table, hs, ds),
                                   dict(NUM_LAYERS=3, HOST_SLOTS=host_layout.num_slots, ITEM_BYTES=item, BLOCK=256))
        load_pages[(hs.numel(), 2 * 3)](*args, **kwargs)
        for kv in range(2):
            for layer in range(3):
                got = device_pool.buffer(kv, layer).view(torch.uint8)
                expect = torch.full_like(got, 0xA5)
                expect[ds] = host_pool.buffer[kv][hs, layer].contiguous().view(torch.uint8)
                assert torch.equal(got, expect), (kv, layer)
    print("moved", hs.numel() * 2 * 3, "items")
    """)


def test_triton_kernel_under_the_interpreter(tmp_path: Path) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (CI installs it; the interpreter needs no GPU)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(pd.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), src, env.get("PYTHONPATH", "")) if p)
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "moved 72 items" in res.stdout
