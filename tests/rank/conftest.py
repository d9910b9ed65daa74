"""What the rank tier's tests share."""

from __future__ import annotations

import pytest

from support.awarejob import uninterrupted


@pytest.fixture(scope="session")
def aware_reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Each rank's output of ``tests/workloads/aware_job.py``, uninterrupted (run once)."""
    pytest.importorskip("torch")
    return uninterrupted(tmp_path_factory.mktemp("aware-reference"))
