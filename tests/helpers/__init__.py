"""What the tests share besides the reference model (tests/reference.py):

* :mod:`.fixtures`: the checked-mode fixture every test runs under (tests/conftest.py);
* :mod:`.models`: :class:`~tests.helpers.models.Model`, the one layout builder of the
  tests' model shapes;
* :mod:`.checks`: :func:`~tests.helpers.checks.assert_round_trip`, a D2H and H2D round
  trip compared byte for byte with the reference, and
  :func:`~tests.helpers.checks.assert_graph_loads`, a captured load replayed with new slots.
* :mod:`.compat`: the byte helpers of the engine call-shape tests (tests/compat):
  poison, compare, sglang's ``uint64`` pointer tables.

Imported from the submodules (tests/reference.py itself uses :mod:`.models`).
"""
