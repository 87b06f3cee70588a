"""Fixtures shared by every test folder.

The local control plane fixtures (``cluster_a``, ``cluster_b``) and their hooks live in
:mod:`kvtopo.cluster.pytest_fixtures`, so integration tests anywhere under ``tests/`` can
request them by name.
"""

pytest_plugins = ["kvtopo.cluster.pytest_fixtures"]
