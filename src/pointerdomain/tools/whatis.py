"""``pointerdomain whatis ADDRESS``: :func:`pointerdomain.explain` from the command line.

pointerdomain's registrations live in the process that made them, so the CLI process
knows none of yours. Three ways to use it:

* inside your process, call ``pointerdomain.explain(addr)`` (or ``exc.explain()`` on a
  typed error that carries an address): owner, offset, domain, alias, rung, NUMA node;
* ``pointerdomain whatis ADDRESS --pid PID``: the memory-map line and NUMA placement of
  the address in process PID (``/proc/PID/maps``; same user or root);
* ``pointerdomain whatis --demo [ADDRESS ...]``: registers a small pool in the CLI process
  and explains its host VA, its device alias, an interior address and any address given,
  to show what an explanation says.
"""

from __future__ import annotations

import argparse
import json
import os

from pointerdomain.arguments import describe
from pointerdomain.tools.cli import EXIT_OK, UsageError, parse_device
from pointerdomain.tools.explanation import Explanation, explain

__all__ = ["add_arguments", "check_pid", "parse_address", "run"]


def parse_address(text: str) -> int:
    """``0x7f00...`` (hex) or decimal -> int in [0, 2**64).

    Raises:
        UsageError: not a number, or out of range.
    """
    try:
        value = int(text, 16) if text.lower().startswith("0x") else int(text, 10)
    except ValueError:
        raise UsageError(f"ADDRESS {describe(text)}: expected hex (0x...) or decimal") from None
    if not 0 <= value < 2**64:
        raise UsageError(f"ADDRESS {describe(text)}: outside [0, 2**64)")
    return value


def check_pid(pid: int) -> None:
    """``--pid`` must name a process whose memory map can be looked at.

    Raises:
        UsageError: ``pid`` is not > 0, or ``/proc/PID/maps`` does not exist (no such
            process, or no /proc: not Linux).
    """
    if pid <= 0:
        raise UsageError(f"--pid {pid}: expected a process id > 0")
    if not os.path.exists(f"/proc/{pid}/maps"):
        raise UsageError(f"--pid {pid}: /proc/{pid}/maps does not exist (no such process, or not Linux)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``whatis`` subcommand's flags."""
    p.add_argument("addresses", nargs="*", metavar="ADDRESS", help="hex (0x...) or decimal address(es)")
    p.add_argument("--pid", type=int, default=None,
                   help="read this process's /proc/PID/maps (its registry is not visible from here); default: this process")
    p.add_argument("--demo", action="store_true",
                   help="register a small pool here and explain its host VA, alias and an interior address")
    p.add_argument("--device", default=None, help="device of the --demo pool (cuda:N or emulated:N; default as demo)")
    p.add_argument("--json", action="store_true", help="print the explanations as a JSON list")


def run(args: argparse.Namespace) -> int:
    """``pointerdomain whatis``: 0 (an address nothing knows is an answer, not a failure).

    Raises:
        UsageError (exit 2): a bad ADDRESS, no ADDRESS, ``--demo`` with ``--pid``,
            ``--device`` without ``--demo``, or a ``--pid`` that names no process (see
            :func:`check_pid`).
    """
    addresses = [parse_address(a) for a in args.addresses]
    if not addresses and not args.demo:
        raise UsageError("give an ADDRESS (hex or decimal), or --demo")
    if args.demo and args.pid is not None:
        raise UsageError("--demo explains addresses of this process: drop --pid")
    if args.device is not None and not args.demo:
        # an address is explained on every device that knows it: the flag would be ignored
        raise UsageError(f"--device {args.device}: names the device of the --demo pool; give --demo, or drop --device")
    if args.pid is not None:
        check_pid(args.pid)
    found: list[Explanation] = []
    if args.demo:
        from pointerdomain.registration.allocation import alloc_registered
        from pointerdomain.registration.resolve import resolve_alias

        device, _why = parse_device(args.device)
        with alloc_registered(3 * 4096, device, max_chunk_bytes=4096) as mem:
            interior = mem.host_va + 5000
            picks = [mem.host_va.value, interior.value, resolve_alias(interior, device).value]
            found = [explain(a) for a in (*picks, *addresses)]
    else:
        found = [explain(a, pid=args.pid) for a in addresses]
    if args.json:
        print(json.dumps([e.to_json() for e in found], indent=2, default=str))
    else:
        print("\n\n".join(e.text() for e in found))
    return EXIT_OK
