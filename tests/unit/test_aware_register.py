"""tpagent_rank.register's checks: a script's mistake is one sentence at the call, not a failure
at the move that would need the registration."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tpagent_rank
from tpagent_rank import aware


@pytest.fixture(autouse=True)
def _none_registered() -> Iterator[None]:
    yield
    aware._REGISTERED = None


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"save": None, "load": print}, "save must be a function returning the training state"),
        ({"save": dict, "load": "state.pt"}, "load must be a function taking a training state"),
        ({"save": dict, "load": print, "replicas": []}, "are not global ranks"),
        ({"save": dict, "load": print, "replicas": [0, -1]}, "are not global ranks"),
        ({"save": dict, "load": print, "replicas": [0, True]}, "are not global ranks"),
        ({"save": dict, "load": print, "replicas": "0,1"}, "are not global ranks"),
    ],
)
def test_a_bad_registration_is_one_sentence_and_registers_nothing(kwargs: dict[str, object], said: str) -> None:
    with pytest.raises(TypeError, match=said):
        tpagent_rank.register(**kwargs)  # type: ignore[arg-type]
    assert aware.registration() is None
    assert aware.replica_ranks() is None
    assert "registered no training state" in aware.why_no_replicas()


def test_a_second_registration_replaces_the_first() -> None:
    tpagent_rank.register(save=dict, load=print, replicas=[0, 1])
    tpagent_rank.register(save=list, load=print)
    reg = aware.registration()
    assert reg is not None and reg.save is list and reg.replicas is None


def test_nothing_registered_has_no_state_to_write_or_read() -> None:
    import io

    with pytest.raises(LookupError, match="registered no training state"):
        aware.write_state(io.BytesIO())
