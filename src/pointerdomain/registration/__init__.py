"""Registered host memory: allocation, registration and its ladder of rungs, leases,
alias resolution, strict alias mode, and the pointer tables and metadata built from it.

The public names are re-exported by :mod:`pointerdomain`; import them from there."""
