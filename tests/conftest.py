"""Fixtures shared by every test folder.

The local control plane fixtures (``cluster_a``, ``cluster_b``) and their hooks live in
:mod:`kvtopo.cluster.pytest_fixtures`, so integration tests anywhere under ``tests/`` can
request them by name.
"""

import os
import shutil
import tempfile

import pytest

pytest_plugins = ["kvtopo.cluster.pytest_fixtures"]

# vLLM names a socket file in VLLM_RPC_BASE_PATH (default: the temp folder) for each of its
# ZeroMQ queues, and leaves it there when its process is stopped or killed: hundreds a
# run. The processes the tests start (vLLM engines, the real vLLM servers) inherit this
# session's own folder instead, removed when the session ends. A path set by the caller
# is kept as it is.
_IPC_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        path = config.stash[_IPC_DIR] = tempfile.mkdtemp(prefix="kvtopo-vllm-ipc-")
        os.environ["VLLM_RPC_BASE_PATH"] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_IPC_DIR, None)
    if path is not None:
        if os.environ.get("VLLM_RPC_BASE_PATH") == path:
            del os.environ["VLLM_RPC_BASE_PATH"]
        shutil.rmtree(path, ignore_errors=True)
