"""How long registering a large pool stalls another process's driver calls.

    python -m benchmarks.registration_stall [--device cuda:0] [--gib 64] [--bound 0.25]
                                            [--threads 16] [--quick] [--json OUT]

Two registrations of the same fresh (never touched) pool, one after the other:

* ``single``: one registration call over the whole pool, single-threaded (the driver
  faults every page in inside the call);
* ``fast``: ``RegistrationPolicy(prefault_threads=N, huge_pages="thp",
  max_call_seconds=BOUND)``: the pages faulted in by N threads first, then calls sized to
  end within the bound (:mod:`pointerdomain.registration.pacing`).

Meanwhile a second process (the "neighbour") calls the driver in a loop
(``cudaMemGetInfo`` through torch on CUDA) and records how long each call took; a call
that waits on the driver lock a registration call holds shows the stall. Each row gives
the registration's wall time, seconds per GiB, calls, its longest single call, the
prefault time, the huge-page share, and the neighbour's longest call during it.

On the emulated device (no GPU; ``--device emulated:0``, small sizes by default) the
driver lock is emulated: each registration call holds an ``flock`` on a file for as long
as it runs and the neighbour's "driver call" takes the same lock, so the neighbour's
stall is the registration's longest call, as with the real driver lock.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import pointerdomain as pd
from pointerdomain._platform import backend_for
from pointerdomain._platform.base import Backend
from pointerdomain._platform.delegating import DelegatingBackend
from pointerdomain._platform.testing import install_backend
from pointerdomain.devices import Device, validate_device


class LockedRegister(DelegatingBackend):
    """Each register / unregister call holds an exclusive ``flock`` on ``path`` while it
    runs: the emulated driver-global lock."""

    def __init__(self, inner: Backend, path: str) -> None:
        super().__init__(inner, "locked")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def register(self, va: int, nbytes: int, device: Device) -> int:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            return super().register(va, nbytes, device)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


def neighbour(device: str, lock: str, stop: str, out: str) -> None:
    """The second process: driver calls in a loop until ``stop`` exists; writes
    ``[(monotonic start, seconds), ...]`` of every call to ``out`` (JSON)."""
    dev = validate_device(device)
    if dev.runtime.host_memory:  # emulated: the "driver call" takes the emulated lock
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)

        def call() -> None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        torch.cuda.mem_get_info(dev.ordinal)  # the context, before the loop

        def call() -> None:
            torch.cuda.mem_get_info(dev.ordinal)
    print("ready", flush=True)
    calls: list[tuple[float, float]] = []
    while not os.path.exists(stop):
        t0 = time.monotonic()
        call()
        calls.append((t0, time.monotonic() - t0))
        time.sleep(0.0005)  # a busy neighbour, not a spinning one
    with open(out, "w") as f:
        json.dump(calls, f)


def fresh_pool(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-aligned, never-touched host memory (a malloc'd mmap)."""
    raw = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
    skip = -raw.data_ptr() % mmap.PAGESIZE
    return raw[skip: skip + nbytes]


def run_case(name: str, device: Device, nbytes: int, policy: pd.RegistrationPolicy, lock: str) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="pd-stall-")
    stop, out = os.path.join(tmp, "stop"), os.path.join(tmp, "calls.json")
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.registration_stall", "--neighbour", str(device),
                              lock, stop, out], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    pool = fresh_pool(nbytes)
    time.sleep(0.2)  # the neighbour's steady state before the registration
    t0 = time.monotonic()
    mem = pd.register_host_tensor(pool, device, policy=policy, max_chunk_bytes=max(nbytes, mmap.PAGESIZE))
    t1 = time.monotonic()
    time.sleep(0.2)
    open(stop, "w").close()
    child.wait(timeout=120)
    with open(out) as f:
        calls = json.load(f)
    during = [d for start, d in calls if start + d >= t0 and start <= t1]
    before = sorted(d for start, d in calls if start + d < t0)
    st = mem.stats
    mem.close()
    del mem, pool
    gib = nbytes / (1 << 30)
    return {
        "case": name, "gib": round(gib, 3), "wall_s": round(t1 - t0, 4), "calls": st.calls,
        "seconds_per_gib": round((t1 - t0) / gib, 4),
        "call_seconds_per_gib": None if st.seconds_per_gib is None else round(st.seconds_per_gib, 4),
        "longest_call_s": round(st.longest_call_s, 4), "prefault_s": round(st.prefault.seconds, 4),
        "prefault_threads": st.prefault.threads, "huge_page_share": st.huge_page_share,
        "neighbour_calls_during": len(during), "neighbour_longest_call_s": round(max(during, default=0.0), 4),
        "neighbour_median_call_s_before": round(before[len(before) // 2], 6) if before else None,
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--neighbour"]:
        neighbour(*argv[1:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda:N or emulated:N (default: cuda:0 if there is a GPU)")
    parser.add_argument("--gib", type=float, default=None, help="pool size, GiB (default: 64 on a GPU, 0.25 emulated)")
    parser.add_argument("--bound", type=float, default=None,
                        help="max_call_seconds of the fast case (default: 0.25 on a GPU, 0.02 emulated)")
    parser.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="prefault threads")
    parser.add_argument("--quick", action="store_true", help="64 MiB: a smoke test, not a measurement")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = validate_device(args.device or ("cuda:0" if torch.cuda.is_available() else "emulated:0"))
    emulated = device.runtime.host_memory
    gib = 1 / 16 if args.quick else args.gib if args.gib is not None else 0.25 if emulated else 64.0
    bound = args.bound if args.bound is not None else 0.02 if emulated else 0.25
    nbytes = int(gib * (1 << 30)) // mmap.PAGESIZE * mmap.PAGESIZE
    lock = os.path.join(tempfile.mkdtemp(prefix="pd-lock-"), "driver.lock")
    cases = [("single", pd.RegistrationPolicy()),
             ("fast", pd.RegistrationPolicy(max_call_seconds=bound, prefault_threads=args.threads, huge_pages="thp"))]
    rows = []
    for name, policy in cases:
        if emulated:
            with install_backend(LockedRegister(backend_for(device), lock), device.type):
                rows.append(run_case(name, device, nbytes, policy, lock))
        else:
            rows.append(run_case(name, device, nbytes, policy, lock))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "bound_s": bound, "threads": args.threads, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
