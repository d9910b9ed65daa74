"""A warning anyone may repeat at will (:class:`host.hushed.Hushed`): once a second at most, the
ones left out counted and said with the next, whatever the flood."""

from __future__ import annotations

import logging

import pytest

from host.hushed import Hushed


def test_a_flood_is_one_line_then_its_count_with_the_next(caplog: pytest.LogCaptureFixture) -> None:
    hushed = Hushed(logging.getLogger("test.hushed"), every=3600.0)
    with caplog.at_level(logging.WARNING, "test.hushed"):
        for i in range(1000):
            hushed.warning("refused connection %d from %s", i, "10.0.0.9")
        assert [r.getMessage() for r in caplog.records] == ["refused connection 0 from 10.0.0.9"]
        hushed.last -= 3600.0  # (the hour has passed)
        hushed.warning("refused connection %d from %s", 1000, "10.0.0.9")
        hushed.warning("refused connection %d from %s", 1001, "10.0.0.9")
    assert [r.getMessage() for r in caplog.records][1:] == [
        "refused connection 1000 from 10.0.0.9 (and 999 more like it not logged)"
    ]
    assert hushed.left_out == 1
