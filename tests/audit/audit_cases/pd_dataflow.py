# Cases for addresses that travel through lists, dicts, tuples, zip and method aliases
# inside one function (recall of PD001, PD003, PD004).
import ctypes

import numpy as np
import torch
from mooncake.engine import TransferEngine


def register_pool(engine, k_bufs, v_bufs, device):
    ptrs = []
    for k, v in zip(k_bufs, v_bufs):
        ptrs.append(k.data_ptr())  # expect[PD002]
        ptrs.append(v.data_ptr())  # expect[PD002]
    table = torch.tensor(ptrs, dtype=torch.uint64, device=device)  # expect[PD001]
    regions = {}
    for name, t in k_bufs.items():
        regions[name] = (t.data_ptr(), t.nbytes)  # expect[PD002]
    addrs, lens = zip(*regions.values())
    engine.batch_register_memory(list(addrs), list(lens))  # expect[PD003]
    return table


def alias(engine, buf, host_array):
    reg = engine.register_memory
    reg(buf.data_ptr(), buf.nbytes)  # expect[PD003]
    raw = ctypes.create_string_buffer(4096)
    reg(ctypes.addressof(raw), 4096)  # expect[PD003]
    engine.register_memory(host_array.ctypes.data, host_array.nbytes)  # expect[PD003]
    for addr, n in [(buf.data_ptr(), buf.nbytes)]:  # expect[PD002]
        engine.unregister_memory(addr)  # expect[PD003]


def transfer(peer, bufs, remote):
    engine = TransferEngine()
    local = [b.data_ptr() for b in bufs]  # expect[PD002]
    for src, dst in zip(local, remote):
        engine.transfer_sync_write(peer, src, dst, 4096)  # expect[PD004]


def host_table(arrays):
    out = []
    for a in arrays:
        out.append(a.ctypes.data)  # expect[PD002]
    return np.array(out, dtype=np.uint64)  # expect[PD001]
