"""GPU health held against thresholds (host/gpuhealth.py), through an injected source of readings;
and Alertmanager's webhook messages read (tpagent/orchestrator/webhook.py)."""

from __future__ import annotations

import json

import pytest

from host.gpuhealth import Reading, Signal, Thresholds, Watch
from tpagent.orchestrator.api import Refused
from tpagent.orchestrator.webhook import alerts_of


class Readings:
    """The readings a test says, one list per call (the last one again after)."""

    def __init__(self, *rounds: list[Reading]) -> None:
        self.rounds = list(rounds)

    def readings(self) -> list[Reading]:
        return self.rounds.pop(0) if len(self.rounds) > 1 else self.rounds[0]


def kinds(w: Watch) -> list[tuple[str, Signal]]:
    return [(f.gpu, f.what) for f in w.findings()]


def test_ecc_counts_rising_pending_retirements_and_lost_gpus_are_findings() -> None:
    w = Watch(
        Readings(
            [Reading("G0", ecc_uncorrected=4), Reading("G1", ecc_uncorrected=0)],
            [Reading("G0", ecc_uncorrected=4), Reading("G1", ecc_uncorrected=1, retire_pending=True)],
            [Reading("G0", lost=True), Reading("G1", ecc_uncorrected=1, remap_pending=True)],
        )
    )
    assert kinds(w) == []  # (4 errors the driver had before: only a rise counts)
    assert kinds(w) == [("G1", Signal.ECC), ("G1", Signal.RETIRE_PENDING)]
    assert kinds(w) == [("G0", Signal.LOST), ("G1", Signal.ECC), ("G1", Signal.REMAP_PENDING)]


def test_temperature_is_held_against_the_gpus_slowdown_less_a_margin_or_a_set_threshold() -> None:
    hot = [Reading("G0", temperature_c=83, slowdown_c=87), Reading("G1", temperature_c=81, slowdown_c=87)]
    assert kinds(Watch(Readings(hot))) == [("G0", Signal.TEMPERATURE)]  # 87 - 5
    assert kinds(Watch(Readings(hot), Thresholds(temperature_c=80))) == [
        ("G0", Signal.TEMPERATURE),
        ("G1", Signal.TEMPERATURE),
    ]
    assert kinds(Watch(Readings([Reading("G0", temperature_c=95)]))) == []  # (no slowdown known, none set)
    cooled = Watch(Readings(hot, [Reading("G0", temperature_c=60, slowdown_c=87)]))
    assert kinds(cooled) == [("G0", Signal.TEMPERATURE)] and kinds(cooled) == []  # only while it is hot


def test_a_critical_xid_stays_a_finding_and_others_are_not() -> None:
    w = Watch(Readings([Reading("G0", xids=(13, 79))], [Reading("G0")]))
    first = w.findings()
    assert [(f.what, f.reading) for f in first] == [(Signal.XID, "critical XID 79")]
    assert kinds(w) == [("G0", Signal.XID)]  # (a reset is a person's call)


def alert(status: str = "firing", **labels: str) -> dict[str, object]:
    return {"status": status, "labels": {"alertname": "GpuDown", **labels}, "annotations": {"summary": "XID 79"},
            "fingerprint": "abc123"}  # fmt: skip


def message(*alerts: dict[str, object], version: str = "4") -> bytes:
    return json.dumps({"version": version, "status": "firing", "alerts": list(alerts)}).encode()


NODE_LABELS = ("node", "instance")
GPU_LABELS = ("UUID",)


def test_alertmanager_messages_name_a_node_and_maybe_a_gpu() -> None:
    got = alerts_of(
        message(alert(node="gpu-1"), alert("resolved", instance="gpu-2:9400", UUID="GPU-9")), NODE_LABELS, GPU_LABELS
    )
    assert [(a.firing, a.node, a.gpu, a.source) for a in got] == [
        (True, "gpu-1", "", "alert:abc123"),
        (False, "gpu-2", "GPU-9", "alert:abc123"),
    ]
    assert got[0].reason == "alert GpuDown: XID 79"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "not JSON"),
        (b'{"version": "4"}', "no list of alerts"),
        (message(alert(node="n"), version="3"), "version '3' is not known"),
        (message(alert(severity="x")), "names no node"),
        (message(alert("maybe", node="n")), "no status firing or resolved"),
        (message({"labels": "x", "status": "firing"}), "no labels"),
    ],
)
def test_a_malformed_message_is_refused_in_one_sentence(body: bytes, says: str) -> None:
    with pytest.raises(Refused, match=says):
        alerts_of(body, NODE_LABELS, GPU_LABELS)
