"""The test suite, one folder per room of the package:

* ``values/``: the value types at the package root (domains, layouts, devices, errors,
  environment variables) and the package face (lazy namespace, layering, docs examples);
* ``registration/``: registered memory, the ladder, leases, tables, strict alias mode;
* ``transfer/``: the launch API, plans, the staged path, overlap, the error word, checked
  mode, the GPU tests and the stateful fuzzer;
* ``tools/``: the command line, doctor, demo, whatis;
* ``platform/``: the platform seam, HIP policy, NUMA, multi-device, the native headers;
* ``adapters/``, ``compat/``, ``audit/``: the engine adapters, the engines' call shapes,
  the static audit.

``reference.py`` is the reference model every expected value comes from; ``helpers/``
holds the shared fixture, layout builder and round-trip check. Marks (pyproject.toml):
``slow`` and ``requires_module`` tests are left out of the fast ``python -m pytest -q``
and run by named stages of ``.ci/run``; ``strict_alias`` tests run there a second time
with ``--strict-alias``; ``gpu`` tests need CUDA (scripts/gpu-check).
"""
