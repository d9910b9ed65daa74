"""The decision a migration's source gives CRIU's holding hook (:func:`snapshot.hook.decide`),
read back as the hook, the dump's rollback and the agent read it, without a hook running."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshot import hook


@pytest.fixture
def out(tmp_path: Path) -> Path:
    (tmp_path / "log").mkdir()
    return tmp_path


@pytest.mark.parametrize("held", [True, False])
@pytest.mark.parametrize("first", [True, False])
def test_a_decision_made_stands_and_a_later_one_is_not_said(out: Path, held: bool, first: bool) -> None:
    """Once said (a word renamed into place as the hook holds, or written before it does), a
    decision stays what it was: a later, contrary one no longer overwrites it (the hook acts on
    the first, and the dump's rollback must read what it acted on)."""
    if held:  # (as hold() makes them)
        for word in hook.WORDS.values():
            (out / "log" / word).touch()
    assert hook.decided(out) is None and hook.may_run(out)
    hook.decide(out, commit=first)
    hook.decide(out, commit=not first)
    assert hook.decided(out) == ("commit" if first else "abort")
    (out / "log" / hook.PINNED_FILE).touch()
    assert hook.may_run(out) is (not first)  # (pinned: runs again only on an abort)
