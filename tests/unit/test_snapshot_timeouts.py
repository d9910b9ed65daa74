"""snapshot.api.Timeouts: every wait of the snapshot layer is a number of seconds its calls can make
(CUDA's lock takes milliseconds in 32 bits: inf, or 50 days, overflowed it after the tree was found)."""

from __future__ import annotations

import pytest

from host.api import MOST_SECONDS
from snapshot.api import Timeouts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "changes",
    [{"cuda_lock": float("inf")}, {"cuda_lock": MOST_SECONDS + 1}, {"dump": float("nan")}, {"pid_wait": -1.0},
     {"stop": 0.0}, {"restore": 1e300}],
)  # fmt: skip
def test_a_wait_its_calls_cannot_make_is_refused(changes: dict[str, float]) -> None:
    name = next(iter(changes))
    with pytest.raises(ValueError, match=f"the {name} timeout .* is not a number of seconds this layer waits"):
        Timeouts(**changes)


def test_the_defaults_and_the_bounds_are_taken() -> None:
    assert Timeouts().cuda_lock == 30.0
    assert Timeouts(cuda_lock=MOST_SECONDS, pid_wait=0.0).pid_wait == 0.0
