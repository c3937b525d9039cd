"""``python -m pointerdomain.audit PATH...`` (the same as ``pointerdomain audit``)."""

from pointerdomain.audit.cli import main

if __name__ == "__main__":  # not when a spawned fix process imports it
    raise SystemExit(main())
