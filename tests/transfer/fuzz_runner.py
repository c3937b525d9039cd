"""The command line both stateful fuzzers share (tests/transfer/fuzz_machine.py and
tests/transfer/fuzz_surface.py): load a hypothesis profile, run the machine once, print a
JSON summary of its counters and write it to ``--summary``. Exit status 1 when the machine
found a failure (hypothesis prints the falsifying example)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine


def main(machine: type[RuleBasedStateMachine], stats: Mapping[str, int], description: str,
         argv: list[str] | None = None, extra: Mapping[str, Any] | None = None) -> int:
    """Run ``machine`` under ``--profile`` (``ci``, ``dev`` or ``long``: the profiles the
    machine's module registered). The summary: ``stats`` (read after the run), ``seconds``,
    ``profile``, ``extra``'s entries, and ``failure`` (empty when none)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--profile", default="ci", choices=["ci", "dev", "long"])
    parser.add_argument("--summary", default="")
    args = parser.parse_args(argv)
    settings.load_profile(args.profile)
    torch.set_num_threads(1)
    start = time.monotonic()
    test = machine.TestCase("runTest")
    failure = ""
    try:
        test.runTest()
    except Exception as exc:  # the falsifying example is printed by hypothesis
        failure = f"{type(exc).__name__}: {exc}"
    summary = dict(stats, seconds=round(time.monotonic() - start, 1), profile=args.profile, **(extra or {}),
                   failure=failure)
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f)
    print(json.dumps(summary))
    return 1 if failure else 0
