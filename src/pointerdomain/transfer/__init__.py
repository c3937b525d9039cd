"""The transfer kernels' launch API: plans, the launch, staged copies, overlap checks,
the device error word, checked mode, KV pools and kernel-table arguments for a cache's own
kernels (:mod:`pointerdomain.transfer.kernel_args`, :mod:`pointerdomain.transfer.triton`).

The public names are re-exported by :mod:`pointerdomain`; import them from there."""
