"""The layer pipeline used as intended: ``HostKVPool.load_layers`` and ``load_layers`` take
kernel tables and give a ``LayerLoad``, whose layers are ints and whose stream is an int or
None. On the emulated device every layer is done when the call returns, so the moved items
are compared with the host's right away; a layer outside the load type-checks and is
refused at runtime."""

from __future__ import annotations

import torch
from _support import DEVICE, raises, slots, small_layout
from typing_extensions import assert_type

from pointerdomain import Device, DeviceKVPool, HostKVPool, LayerLoad, TransferBackend, load_layers
from pointerdomain.errors import IndexValidationError

pool = DeviceKVPool(small_layout("layer_first"), DEVICE)
backend: TransferBackend = "kernel"
with HostKVPool(small_layout("page_first"), DEVICE) as host:
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=torch.Generator().manual_seed(0)))
    done = host.load_layers(pool, slots(0, 5), slots(3, 1), backend=backend)
    assert_type(done, LayerLoad)
    assert_type(done.num_layers, int)
    assert_type(done.device, Device)
    assert_type(done.stream, int)
    for layer in range(done.num_layers):
        assert_type(done.wait(layer), None)
        assert_type(done.wait(layer, stream=None), None)
        assert_type(done.ready(layer), bool)
        for kv in range(pool.layout.num_kv):
            # page_first host buffer [kv, slots, layers, heads, head_dim]: host slots 0, 5 -> device slots 3, 1
            assert torch.equal(pool.buffer(kv, layer)[slots(3, 1)], host.buffer[kv][slots(0, 5), layer])
    assert_type(done.synchronize(), None)
    again = load_layers(host.kernel_table, pool.table, slots(2), slots(0), src_layout=host.layout,
                        dst_layout=pool.layout, max_ctas=1)
    assert_type(again, LayerLoad)
    again.wait(again.num_layers - 1)
    assert torch.equal(pool.buffer(0, 1)[0], host.buffer[0][2, 1])
    with raises(IndexValidationError, "outside [0, 2)"):
        again.wait(again.num_layers)
