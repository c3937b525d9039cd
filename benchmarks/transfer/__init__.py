"""KV page transfer benchmark (pointerdomain): a device KV pool (layer_first, one buffer
per K/V layer) <-> a registered host pool (page_first by default), random page order,
against the usual ways of moving the same bytes.

Run from the repository root::

    python -m benchmarks.transfer                 # CUDA: 1 GiB per point, 32 layers (H200: a few minutes)
    python -m benchmarks.transfer --quick         # smoke test (CI, CPU): a few MiB per point, 1 thread
    python benchmarks/transfer --help             # the same, as a directory

Modules: :mod:`.common` (sizes, formatting, a case's pools and their torch reference; it
imports no other module here), :mod:`.harness` (poison / check / time one cell, the sweep),
:mod:`.methods` (what is measured: bulk copy, per-item copies, the library's copy-engine
and kernel paths at each CTA budget, torch indexing, two simple reference kernels),
:mod:`.report` (tables, targets, peer reference figures, JSON, plot).

Only the public API (``pointerdomain.transfer_kv_all_layer`` / ``transfer_kv_per_layer``,
pools, tables, layouts) and torch are called; the reference for every check is torch
indexing of the layouts' one-buffer shapes (``KVLayout.buffer_shape``).
"""

__all__ = ["main"]


def main(argv: "list[str] | None" = None) -> int:
    from benchmarks.transfer.harness import main as _main

    return _main(argv)
