"""Adapter objects that own registrations or tables are process-local: pickle and copy
refuse them with NotPicklableError instead of failing deep inside or making a second
owner of the same registrations."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters import lmcache, mooncake, nixl, sglang, vllm
from tests.reference import DEV, model_layout


class Stub:
    def __getattr__(self, name: str) -> Any:
        return lambda *args: ("handle", 1) if name == "register_memory" else 0


def owners(pool: pd.HostKVPool, device: pd.DeviceKVPool) -> list[object]:
    agent = nixl.HostNixlAgent("a", agent=Stub())
    registration = agent.register([nixl.dram_desc(pool.get_contiguous_buf_infos()[0])])
    engine = mooncake.HostTransferEngine(Stub(), "127.0.0.1")
    return [
        engine, agent, registration,
        sglang.HostKVCacheAdapter.from_pool(pool),
        sglang.DeviceKVBuffers.mha([device.buffer(0, i) for i in range(3)], [device.buffer(1, i) for i in range(3)],
                                   DEV, page_size=4),
        lmcache.LayerPointerCache(), lmcache.PagedKVConnector(),
    ]


@pytest.mark.parametrize("how", [pickle.dumps, copy.copy, copy.deepcopy], ids=["pickle", "copy", "deepcopy"])
def test_adapter_owners_refuse_pickle_and_copy(how: Callable[[object], object]) -> None:
    device = pd.DeviceKVPool(model_layout("layer_first"), DEV)
    with pd.HostKVPool(model_layout("page_first"), DEV) as pool:
        for obj in owners(pool, device):
            with pytest.raises(errors.NotPicklableError, match=type(obj).__name__):
                how(obj)


def test_every_adapter_class_holding_state_is_process_local() -> None:
    names = {
        mooncake: ["HostTransferEngine"], nixl: ["HostNixlAgent", "NixlRegistration"],
        sglang: ["HostKVCacheAdapter", "DeviceKVBuffers"], vllm: ["CpuGpuBlockOffload"],
        lmcache: ["LayerPointerCache", "PagedKVConnector"],
    }
    from pointerdomain.process_local import ProcessLocal
    for module, classes in names.items():
        for name in classes:
            assert issubclass(getattr(module, name), ProcessLocal), name
