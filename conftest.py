"""Repository-wide pytest hooks (the packages' own fixtures are in their tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make ``--dist loadgroup`` group again. xdist 3.8 names an item's group by writing ``item._nodeid``
    (``...::test@ray``), which pytest 9 no longer reads (``nodeid`` is ``item._id``): no test was grouped, so
    each worker started its own Ray, worker groups and module fixtures, again after every change of directory."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        suffixed = item.__dict__.get("_nodeid")
        if isinstance(suffixed, str) and suffixed != item.nodeid:
            item._id = coerce_node_id(suffixed)
