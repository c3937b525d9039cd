"""Command line: ``pointerdomain doctor``, ``demo``, ``whatis`` and ``audit``.

Exit codes, for every subcommand: 0 ok; 1 failure (the command ran and something
failed: a self-test, a verification, a runtime or registration error, a missing
extension); 2 usage (the command line asks for something that cannot be run as
given: an unknown flag, a bad value, a device that does not exist, a size that does
not fit; nothing was run). Output cut short by its reader (``| head``) is exit 1, quietly.

Subcommands are rows of :data:`COMMANDS`: a module with ``add_arguments(parser)`` and
``run(args) -> int``, imported when the parser is built. A command whose module needs an
optional extra (``audit``: libcst) is still listed without it and says what to install.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pointerdomain.arguments import describe
from pointerdomain.devices import DEVICE_TYPES, Device
from pointerdomain.errors import InvalidDeviceError, PointerDomainError

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "Command", "UsageError", "main", "parse_device"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class Command(NamedTuple):
    """One subcommand: its name, one-line help, the module that implements it, and the
    pip extra its module needs (None: none)."""

    name: str
    help: str
    module: str
    extra: str | None = None


COMMANDS: tuple[Command, ...] = (
    Command("doctor", "platform matrix per device: attributes, NUMA, ladder rungs, self-test (--json for bug reports)",
            "pointerdomain.tools.doctor"),
    Command("demo", "back up random KV pages to registered host memory, clobber, load, verify", "pointerdomain.tools.demo"),
    Command("whatis", "what an address is: registration, alias, device memory, memory-map line", "pointerdomain.tools.whatis"),
    Command("audit", "find raw integer addresses (PD rules); CI gate (docs/audit.md)", "pointerdomain.audit.cli",
            extra="audit"),
)


class UsageError(Exception):
    """A command-line value that cannot be run as given (exit code 2); the message names the flag."""


#: ``--device`` texts naming the plain CPU, which is no device here
_PLAIN_CPU: frozenset[str] = frozenset({"cpu", "cpu:0"})


def parse_device(text: str | None) -> tuple[Device, str]:
    """The device a ``--device`` flag names, and a phrase saying why it is the one used.

    Raises:
        UsageError: ``cpu`` (pointerdomain has no plain CPU device: say emulated:0) or a
            device that does not exist.
    """
    from pointerdomain._platform import default_device
    from pointerdomain.devices import validate_device

    if text is None:
        dev = default_device()
        why = "no GPU with the GPU ops: the CPU stand-in" if dev.runtime.host_memory else "a GPU with the GPU ops is present"
        return dev, f"default: {why}"
    if text.strip().lower() in _PLAIN_CPU:
        raise UsageError(
            f"--device {text}: there is no plain CPU device (registered memory needs a device to alias it). "
            "Use --device emulated:0, the CPU stand-in whose device aliases differ from host VAs, or cuda:N"
        )
    kind = text.strip().partition(":")[0]
    if kind not in DEVICE_TYPES:
        raise UsageError(f"--device {text}: found {describe(text)}, expected cuda:N or emulated:N (emulated:0 is the CPU stand-in)")
    try:
        return validate_device(text), "--device"
    except InvalidDeviceError as exc:
        raise UsageError(f"--device {text}: {exc}") from None


def _version() -> str:
    from pointerdomain.buildinfo import version_text

    return version_text()


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its
    default or there is none to say (argparse's own formatter appends it always)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is None or action.default is argparse.SUPPRESS:
            return text
        if action.option_strings and action.nargs != 0:
            return f"{text} (default: %(default)s)"
        return text


#: What ``pointerdomain --help`` says: the module docstring up to the notes for developers.
_USAGE = __doc__.split("\n\nSubcommands are rows")[0] if __doc__ else None


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand of :data:`COMMANDS`; defaults shown in ``--help`` once."""
    fmt = _DefaultsOnce
    parser = argparse.ArgumentParser(prog="pointerdomain", description=_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help, formatter_class=fmt)
        try:
            module = importlib.import_module(command.module)
        except ImportError as exc:
            if command.extra is None:
                raise
            p.add_argument("rest", nargs=argparse.REMAINDER, help=f"needs pip install 'pointerdomain[{command.extra}]'")
            p.set_defaults(_run=_missing_extra(command, exc))
            continue
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _missing_extra(command: Command, exc: ImportError) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        raise UsageError(f"pointerdomain {command.name} needs pip install 'pointerdomain[{command.extra}]' ({exc})")

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2 here (argparse)
    try:
        code = int(args._run(args))
        sys.stdout.flush()  # a reader gone early (`| head`) shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return EXIT_FAILURE
    except UsageError as exc:
        print(f"pointerdomain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PointerDomainError as exc:
        print(f"pointerdomain {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    # `python -m pointerdomain.tools.cli`: run the imported module's main, so the subcommands'
    # UsageError is the class main catches (this file runs as __main__, a second copy).
    from pointerdomain.tools.cli import main as _main

    raise SystemExit(_main())
