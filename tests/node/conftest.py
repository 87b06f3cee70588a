"""The real node's tests (tier c) share one cluster (``cluster_c``); the test marked
``node_teardown`` stops it and checks the machine, so it runs last in the session."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    last = [item for item in items if item.get_closest_marker("node_teardown")]
    for item in last:
        items.remove(item)
    items.extend(last)
