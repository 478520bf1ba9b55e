"""Shared pytest setup: ``@pytest.mark.cuda`` tests are skipped on machines without CUDA; shared fixtures."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one intra-op thread is as fast and does not fight the other tests for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
