"""Drop-in call shapes of the engines' own KV transfer ops, checked before launch.

Each submodule mirrors one engine's functions (same names, positional and keyword
parameters, defaults), so adopting the library's checks starts with one import line:

* :mod:`pointerdomain.compat.sgl_kernel` -- sglang's ``sgl_kernel.kvcacheio``;
* :mod:`pointerdomain.compat.sgl_hicache` -- sglang's JIT hicache ops;
* :mod:`pointerdomain.compat.lmcache` -- LMCache's ``c_ops`` KV transfers;
* :mod:`pointerdomain.compat.vllm` -- vLLM's ``swap_blocks`` / ``swap_blocks_batch``;
* :mod:`pointerdomain.compat.wrap` -- :func:`~pointerdomain.compat.wrap.kernel_op`, a typed
  front (``PointerTable[DeviceAlias]`` parameters) for any other op that takes raw tables.

Every raw address such a call carries (``data_ptr()`` ints, ``uint64`` pointer tables)
is resolved first: translated to the device alias inside a known registration or
runtime-pinned allocation, checked to be device memory of the launch's device, its reach
checked against its allocation; anything else is a typed error before anything runs
(:mod:`pointerdomain.compat._raw` has the rules and what its cache can and cannot see).
Then the transfer runs through the public API (:func:`pointerdomain.transfer_kv_all_layer`
and friends). docs/adoption.md shows the path from here to the typed API.
"""

from pointerdomain.compat._raw import clear_cache

__all__ = ["clear_cache"]
