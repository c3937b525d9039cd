"""One side of the two-process Mooncake test (tests/adapters/test_mooncake.py); run as a script.

``serve``: fill a device KV pool, back selected pages up into a host pool through
the kernels, register the host pool with a Mooncake engine using only HostVA
metadata, publish the engine's session id and the pages' HostVA blocks, and wait
on stdin until the test is done.

``pull``: read that, pull the pages into its own host pool with
``batch_transfer_sync_read``, load them into its device pool through the kernels,
and save what landed.

Both run on the emulated device, where device aliases differ from host VAs, so an
alias that reached the engine would not be the memory registered by VA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import pointerdomain as pd
from pointerdomain import errors
from pointerdomain.adapters.mooncake import HostTransferEngine
from tests.helpers.models import Model
from tests.reference import page_items, page_slots  # the checkout is on the child's PYTHONPATH (tests/childenv.py)

DEV = "emulated:0"


def layouts() -> tuple[pd.KVLayout, pd.KVLayout]:
    """(device layout, host layout): MHA, 3 layers, 4-token pages, 2 heads x 64, bf16."""
    model = Model(mha=(2, 64))
    return model.layout("layer_first", 10), model.layout("page_first", 8)


def engine() -> HostTransferEngine:
    last: Exception | None = None
    for _ in range(3):  # the engine picks its own ports; retry a rare clash
        try:
            return HostTransferEngine.create("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        except errors.RuntimeCallError as exc:
            last = exc
            time.sleep(0.5)
    assert last is not None
    raise last


def write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def serve(args: argparse.Namespace) -> None:
    dev_layout, host_layout = layouts()
    device = pd.DeviceKVPool(dev_layout, DEV)
    g = torch.Generator().manual_seed(args.seed)
    for buf in device.buffers:
        flat = buf.view(torch.uint8).view(-1)
        flat.copy_(torch.randint(1, 256, flat.shape, dtype=torch.uint8, generator=g))
    host = pd.HostKVPool(host_layout, DEV)
    host.buffer.zero_()
    src_pages = [int(p) for p in args.device_pages.split(",")]
    host_pages = [int(p) for p in args.host_pages.split(",")]
    ps = dev_layout.page_size
    host.backup(device, page_slots(src_pages, ps), page_slots(host_pages, ps))
    torch.save(page_items(device, src_pages), args.expected)

    eng = engine()
    # The engine takes HostVA metadata only: a device alias is refused before it is called.
    alias_rejected = False
    try:
        eng.register_memory(host.kernel_table[0], host_layout.nbytes)  # type: ignore[arg-type]
    except errors.DomainError:
        alias_rejected = True
    eng.batch_register_memory(host.get_contiguous_buf_infos())
    blocks = host.get_page_buffer_meta(host_pages)
    write_atomic(args.ready, json.dumps({
        "session": eng.session_id,
        "blocks": [b.model_dump_json() for b in blocks],
        "alias_rejected": alias_rejected,
        "alias_differs": host.kernel_table[0].value != host.host_table[0].value,
    }))
    sys.stdin.readline()  # the test writes a line (or closes stdin) when the peer is done
    eng.close()
    host.close()


def pull(args: argparse.Namespace) -> None:
    info = json.load(open(args.ready))
    remote = [pd.BufferInfo.model_validate_json(b) for b in info["blocks"]]
    dev_layout, host_layout = layouts()
    device = pd.DeviceKVPool(dev_layout, DEV)
    for buf in device.buffers:
        buf.zero_()
    host = pd.HostKVPool(host_layout, DEV)
    host.buffer.zero_()
    local_pages = [int(p) for p in args.host_pages.split(",")]
    dst_pages = [int(p) for p in args.device_pages.split(",")]
    local = host.get_page_buffer_meta(local_pages)
    assert [b.nbytes for b in local] == [b.nbytes for b in remote], "the two pools' page blocks do not match"

    eng = engine()
    eng.batch_register_memory(host.get_contiguous_buf_infos())
    t0 = time.perf_counter()
    moved = eng.batch_transfer_sync_read(info["session"], local, remote)
    t1 = time.perf_counter()
    ps = dev_layout.page_size
    host.load(device, page_slots(local_pages, ps), page_slots(dst_pages, ps))
    torch.save(page_items(device, dst_pages), args.result)
    eng.close()
    host.close()
    print(json.dumps({"bytes": moved, "blocks": len(local), "read_seconds": t1 - t0}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["serve", "pull"])
    parser.add_argument("--ready", required=True, help="JSON file the server writes when registered")
    parser.add_argument("--device-pages", required=True)
    parser.add_argument("--host-pages", required=True)
    parser.add_argument("--expected", help="serve: where to save the source pages")
    parser.add_argument("--result", help="pull: where to save the loaded pages")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    torch.set_num_threads(1)
    serve(args) if args.role == "serve" else pull(args)


if __name__ == "__main__":
    main()
