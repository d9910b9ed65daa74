"""The host identity a rank reports (tpagent_rank.nccladdr.host_identity): what NCCL tells hosts
apart by (its host name and boot id, or the NCCL_HOSTID its process sets), so that the agent
never builds communicators with a rank whose NCCL still believes it runs on another host."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tpagent_rank import nccladdr


def test_a_host_is_its_name_and_boot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert nccladdr.host_identity() == nccladdr.host_identity(as_nccl=True) == f"{socket.gethostname()}|{boot}"


def test_nccl_hostid_is_what_nccl_holds_but_not_where_the_process_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_HOSTID", "rack7")
    assert nccladdr.host_identity(as_nccl=True) == "NCCL_HOSTID=rack7"
    assert nccladdr.host_identity().startswith(socket.gethostname() + "|")
