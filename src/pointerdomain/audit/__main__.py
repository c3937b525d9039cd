"""``python -m pointerdomain.audit PATH...`` (the same as ``pointerdomain audit``)."""

from pointerdomain.audit.cli import main

raise SystemExit(main())
