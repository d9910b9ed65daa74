"""Whose a UID is (host.peers.account): the owner of the subordinate range it falls in."""

from __future__ import annotations

import pwd
from pathlib import Path

import pytest

from host import peers


def test_a_subordinate_uid_is_its_owners(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = pwd.getpwnam("daemon").pw_uid
    (tmp_path / "subuid").write_text("daemon:100000:65536\n4242:200000:10\nno-such-user:300000:10\nbroken line\n")
    monkeypatch.setattr(peers, "SUBUID", tmp_path / "subuid")
    assert [peers.account(u) for u in (100000, 165535, 165536)] == [daemon, daemon, 165536]
    assert peers.account(200009) == 4242 and peers.account(300001) == 300001 and peers.account(0) == 0
    monkeypatch.setattr(peers, "SUBUID", tmp_path / "none")
    assert peers.account(100000) == 100000
