"""Node A of the two-process NIXL test (tests/adapters/test_nixl.py); run as a script.

Fills a device KV pool, backs selected pages up into a host pool through the library's
transfer kernels, registers the host pool with a NIXL agent (UCX back-end) from its
HostVA metadata only, saves the bytes it sent, prints one JSON line (agent name,
metadata, the pages' BufferInfo blocks) and waits on stdin until node B is done. Then
it closes the pool (which deregisters it from NIXL first) and the agent.

The emulated device is used, where device aliases differ from host VAs: an alias in a
DRAM descriptor would name memory that is not the registered pool.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys

import torch

import pointerdomain as pd
from pointerdomain.adapters.nixl import HostNixlAgent
from tests.helpers.models import Model
from tests.reference import page_items, page_slots  # the checkout is on the child's PYTHONPATH (tests/childenv.py)

DEV = "emulated:0"
#: Prefix of this script's own stdout lines (NIXL logs to stdout too).
MARK = "NIXL_PEER "


def layouts() -> tuple[pd.KVLayout, pd.KVLayout]:
    """(device layout, host layout): MHA, 3 layers, 4-token pages, 2 heads x 32, bf16."""
    model = Model(mha=(2, 32))
    return model.layout("layer_first", 10), model.layout("page_first", 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--dev-pages", type=int, nargs="+", required=True)
    ap.add_argument("--host-pages", type=int, nargs="+", required=True)
    ap.add_argument("--expected", required=True, help="where to torch.save the bytes of the pages sent")
    args = ap.parse_args()

    dev_layout, host_layout = layouts()
    device_pool = pd.DeviceKVPool(dev_layout, DEV)
    g = torch.Generator().manual_seed(1234)
    for t in device_pool.buffers:
        t.view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                                                generator=g).view(t.view(torch.uint8).shape))
    host_pool = pd.HostKVPool(host_layout, DEV)
    host_pool.backup(device_pool, page_slots(args.dev_pages, dev_layout.page_size),
                     page_slots(args.host_pages, host_layout.page_size))
    torch.save(page_items(device_pool, args.dev_pages), args.expected)

    agent = HostNixlAgent(args.name, ["UCX"])
    reg = agent.register_pool(host_pool)
    print(MARK + json.dumps({
        "name": agent.name,
        "metadata": base64.b64encode(agent.metadata()).decode(),
        "blocks": [b.model_dump_json() for b in host_pool.get_page_buffer_meta(args.host_pages)],
    }), flush=True)
    sys.stdin.readline()            # B is done reading
    host_pool.close()               # deregisters from NIXL first (close hook), then unregisters
    assert reg.closed and not agent.registrations()
    agent.close()
    print(MARK + json.dumps({"closed": True}), flush=True)


if __name__ == "__main__":
    main()
