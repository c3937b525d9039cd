"""``python -m benchmarks.transfer`` or ``python benchmarks/transfer``."""

import os
import sys

if not __package__:  # run as a directory: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.transfer.harness import main  # noqa: E402

sys.exit(main())
