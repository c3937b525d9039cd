"""The staged copy-engine path: ``backend="staged"`` is a TransferBackend like the
others, its staging configuration is typed, and what the types cannot say (all layers
only, a host pool whose slot is one block) is refused at runtime before anything moves."""

from __future__ import annotations

import torch
from _support import DEVICE, raises, slots, small_layout
from typing_extensions import assert_type

from pointerdomain import DeviceKVPool, HostKVPool, TransferBackend, staged, transfer_kv_per_layer
from pointerdomain.errors import InvalidArgumentError, LayoutError

choice: TransferBackend = "staged"
config = staged.staging_config(DEVICE)
assert_type(config, staged.StagingConfig)
assert_type(config.nbytes, int)
assert_type(staged.chunk_slots(config, 2, 4096), int)
staged.set_staging(DEVICE, nbytes=8 << 20, ring=4)
limit: int = staged.MAX_STAGING_BYTES  # a Final int: 16 GiB
with raises(InvalidArgumentError, "at most"):  # past the bound: refused before anything is allocated
    staged.set_staging(DEVICE, nbytes=staged.MAX_STAGING_BYTES + 4096)

pool = DeviceKVPool(small_layout("layer_first"), DEVICE)
with HostKVPool(small_layout("page_first"), DEVICE) as host:
    host.load(pool, slots(0, 1), slots(2, 3), backend=choice)  # all layers, page_first: it runs
    assert_type(host.load(pool, slots(0), slots(1), backend="staged", max_ctas=2), None)
    # one layer type-checks, and is refused: the staged path moves all layers
    with raises(InvalidArgumentError, "all layers"):
        transfer_kv_per_layer(host.kernel_table, pool.table, slots(0), slots(1), layer_id=0,
                              src_layout=host.layout, dst_layout=pool.layout, backend="staged")
with HostKVPool(small_layout("page_first_direct"), DEVICE) as direct:
    with raises(LayoutError, "contiguously"):  # 4-token pages: a slot's layers are 4 items apart
        direct.load(pool, slots(0), slots(1), backend="staged")
staged.set_staging(DEVICE)
assert torch.equal(slots(1), torch.tensor([1]))
