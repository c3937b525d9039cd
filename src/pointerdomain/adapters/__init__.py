"""Adapters that let an existing KV cache adopt pointerdomain while keeping its call shapes.

Each module mirrors one convention without importing the project it mimics:

* :mod:`pointerdomain.adapters.sglang` -- a HiCache-style host pool
  (``make_kernel_ptr_table(tensors, target_device, *, host_memory_registered)``,
  ``get_contiguous_buf_infos()``, ``get_page_buffer_meta(indices)``);
* :mod:`pointerdomain.adapters.vllm` -- block offload: per-block source and
  destination address arrays for a batch copy (``swap_blocks_batch`` /
  ``cudaMemcpyBatchAsync``), built from kernel tables so that only device
  aliases reach the copy call;
* :mod:`pointerdomain.adapters.lmcache` -- multi-layer transfer with per-device
  cached layer-pointer tables that are rebuilt when the KV tensors change;
* :mod:`pointerdomain.adapters.mooncake` -- a typed wrapper around a transfer
  engine (Mooncake ``TransferEngine``) that accepts only host VAs;
* :mod:`pointerdomain.adapters.outcomes` -- Mooncake and NIXL results as transfer
  outcomes (done, failed, partial with the blocks not copied).

The rule every adapter enforces: kernel tables and batch-copy descriptors carry
:class:`~pointerdomain.DeviceAlias`; metadata, transfer engines, storage
back-ends and unregister calls carry :class:`~pointerdomain.HostVA`.
See docs/embedding.md.
"""

from pointerdomain.adapters import lmcache, mooncake, sglang, vllm

__all__ = ["lmcache", "mooncake", "sglang", "vllm"]
