"""The rank protocol, typed once (tpagent_rank/protocol.py): every request and answer crosses both
wires (the rank's line, the agents' gRPC Rank call) and comes back equal; what is not a message of
the protocol is refused with a ProtocolError (on the line) or Refused (on gRPC), never taken as a
wrong value."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest

from tpagent.daemon import rankwire
from tpagent.migration.api import Refused, Why
from tpagent_rank import codec, lines
from tpagent_rank import protocol as P

#: One request of each op, every field set to something other than its default.
REQUESTS: list[P.Request[Any]] = [
    P.Where(),
    P.Peers(),
    P.Pause(at=41, unit=P.Unit.COLLECTIVE.value),
    P.Boundary(timeout=12.5),
    P.Cancel(),
    P.Teardown(leaving=True),
    P.Rebuild(gen=3, timeout=7.0),
    P.Resume(),
    P.End(why="rank 2 is gone", grace=2.5),
    P.Save(listen="10.0.0.1", secret="ab" * 16, timeout=30.0, held=True),
    P.Load(size=1 << 33, step=12, collectives=40, source="10.0.0.1:4000", secret="ab" * 16, groups=3),
    P.Retire(),
    P.Restart(store="10.0.0.2:41234"),
    P.Settle(),
    P.Expect(pid=4242),
    P.Moved(to="10.0.0.2:7400"),
    P.Release(),
    P.Locate(),
    P.Signal(signum=15),
    P.Output(fd=2, offset=1 << 33, max=4096),
    P.Jobs(),
    P.Lost(node="10.0.0.2:7400", why="node b stopped reporting", grace=10.0, users=(1000,), died=True),
    P.Join(
        cmd=("python3", "train.py", "--steps", "9"),
        env=("RANK=1", "WORLD_SIZE=4"),
        cwd="/home/u",
        umask=0o022,
        uid=1000,
        gid=1000,
        groups=(27, 1000),
        stdout="/home/u/out",
        stderr="/home/u/err",
        owner=1000,
    ),
    P.Recover(
        node="10.0.0.2:7400",
        ranks=(2, 3),
        spare="10.0.0.9:7400",
        grace=60.0,
        agents=("10.0.0.1:7400", "", ""),
        died=True,
    ),
    P.Rebuilt(to="10.0.0.9:7400", hold=960.0),
]
#: One answer of each kind, every field set.
ANSWERS: list[P.Answer] = [
    P.Answer(ok=False, error="no"),
    P.Standing(
        step=9,
        collectives=27,
        gen=2,
        state=P.RankState.PAUSED.value,
        rate=3.5,
        collective_rate=10.5,
        groups=2,
        nccl_host="h|b",
        nccl_ras=True,
        host="h|b",
        hosts_store="10.0.0.1:29500",
        store_loopback="127.0.0.1:29500",
        aware=True,
        replicas=(1, 3),
        no_replicas="",
        held=9,
        broken="Connection reset by peer",
        store="10.0.0.1:29500",
        agreed="0f" * 16,
    ),
    P.Agents(agents=("10.0.0.1:7400", "", "10.0.0.3:7400")),
    P.Paused(ok=False, error="past it", late=True),
    P.AtBoundary(step=5, collectives=15),
    P.TornDown(closed=2),
    P.Saved(size=1 << 33, step=12, collectives=40, port=4000, groups=3),
    P.Located(state=P.Whereabouts.MOVED.value, pid=7, node="10.0.0.2:7400", code=3, anew=True),
    P.Written(data=bytes(range(256)), size=1 << 33),
    P.Ranks(
        ranks=(
            P.RankRow(
                "j",
                1,
                world=4,
                pid=9,
                gen=2,
                step=8,
                connected=True,
                moved_to="x:1",
                state="running",
                aware=True,
                replicas=(0, 1),
            ),
        )
    ),
    P.Recovered(step=12, gen=3, stages=("detection=10.5", "rebuild=0.25"), store="10.0.0.2:41234", ranks=(2, 3)),
]


def test_every_op_has_one_request_and_every_request_its_answer() -> None:
    assert set(P.REQUESTS) == set(P.Op) and {type(r) for r in REQUESTS} == set(P.REQUESTS.values())
    assert set(P.Op) > P.RUNTIME_OPS
    kinds = {type(a) for a in ANSWERS}
    assert all(cls.ANSWER in kinds for cls in P.REQUESTS.values())


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.OP.value)
def test_a_request_crosses_the_line_and_grpc_unchanged(request_: P.Request[Any]) -> None:
    body = codec.parse_line(codec.request_line(7, request_))
    assert body["id"] == 7 and body["op"] == request_.OP.value
    assert codec.decode_request(body) == request_
    message = rankwire.request_pb("job", 3, request_, 30.0)
    again = type(message).FromString(message.SerializeToString())
    assert (again.job, again.rank, again.timeout) == ("job", 3, 30.0)
    assert rankwire.request_of(again) == request_


def test_a_join_of_a_command_environment_or_path_that_is_no_utf8_crosses_grpc_as_its_bytes() -> None:
    """How a rank runs is bytes (read from /proc, as surrogate escapes), and protobuf's strings are
    UTF-8: a join of one such byte could not be sent at all (its model-aware move, the rebuild of
    a lost rank from it, failed).  It goes as its bytes and comes out as it went in; a join of
    UTF-8 goes as before (an agent older than ``latin1`` reads it)."""
    (join,) = [r for r in REQUESTS if isinstance(r, P.Join)]
    odd = dataclasses.replace(
        join,
        cmd=("python3", os.fsdecode(b"caf\xe9.py"), "na\u00efve \u4e2d"),
        env=("A=\u00e9", os.fsdecode(b"B=\xff\xfe")),
        cwd=os.fsdecode(b"/home/\xe9"),
        stdout=os.fsdecode(b"/tmp/\x80.out"),
    )
    message = rankwire.request_pb("job", 3, odd, 30.0)
    again = type(message).FromString(message.SerializeToString())
    assert again.join.latin1 and rankwire.request_of(again) == odd
    plain = rankwire.request_pb("job", 3, join, 30.0)
    assert not plain.join.latin1 and list(plain.join.cmd) == list(join.cmd)
    again.join.cmd[0] = "\u4e2d"  # (no byte: a character past U+00FF)
    with pytest.raises(Refused, match="not one of the rank protocol") as e:
        rankwire.request_of(again)
    assert e.value.why is Why.INVALID


def test_a_request_grpc_cannot_carry_is_refused_in_one_sentence_and_not_sent() -> None:
    """(A join of bytes that were no UTF-8 raised protobuf's UnicodeEncodeError through the model-
    aware move, which then waited in vain for its rank on the target.)"""
    from tpagent.daemon.client import GrpcPeer

    peer = GrpcPeer.__new__(GrpcPeer)
    peer._stub = None  # (any call made on it fails this test)
    for request in (P.End(why="caf\udce9"), P.Pause(at=1 << 64)):
        with pytest.raises(Refused, match=r"^the request cannot be sent \(") as e:
            peer.rank("job", 1, request, 5.0)
        assert e.value.why is Why.INVALID


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: type(a).__name__)
def test_an_answer_crosses_the_line_and_grpc_unchanged(answer: P.Answer) -> None:
    request = next(r for r in REQUESTS if r.ANSWER is type(answer))
    body = codec.parse_line(codec.line(answer, id=7))
    assert codec.decode_answer(request, body) == answer
    reply = rankwire.reply_pb(answer)
    again = type(reply).FromString(reply.SerializeToString())
    assert rankwire.answer_of(request, again) == answer


def test_an_error_answer_of_a_typed_kind_keeps_its_kind_with_defaults() -> None:
    """A rank that fails a where (or a runtime that could not decode the request) answers only ok
    and error: the agent still gets a Standing, every other field at its default."""
    got = codec.decode_answer(P.Where(), {"id": 1, "ok": False, "error": "ValueError: x"})
    assert got == P.Standing(ok=False, error="ValueError: x")
    assert rankwire.answer_of(P.Where(), rankwire.reply_pb(P.failed("no"))) == P.Standing(ok=False, error="no")


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"op": "pause", "at": "5"}, "at is not an integer"),
        ({"op": "pause", "at": True}, "at is not an integer"),
        ({"op": "pause", "at": 1 << 63}, "at is not an integer of 64 bits"),
        ({"op": "pause"}, "Pause lacks at"),
        ({"op": "teardown", "leaving": 1}, "leaving is not true or false"),
        ({"op": "boundary", "timeout": float("nan")}, "timeout is not a number"),
        ({"op": "end", "why": ["x"]}, "why is not text"),
        ({"op": "drop_tables"}, "is not an operation of the rank protocol"),
        ({"at": 1}, "is not an operation of the rank protocol"),
    ],
)
def test_what_is_not_a_request_is_refused_by_name(body: dict[str, Any], said: str) -> None:
    with pytest.raises(P.ProtocolError, match=said):
        codec.decode_request(body)


def test_an_answer_with_a_field_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(P.ProtocolError, match="step is not an integer"):
        codec.decode_answer(P.Where(), {"ok": True, "step": "lots"})
    with pytest.raises(P.ProtocolError, match="step is not an integer of 64 bits"):
        codec.decode_answer(P.Where(), {"ok": True, "step": 1 << 64})  # (it could not be passed on between agents)
    with pytest.raises(P.ProtocolError, match="agents.. is not text"):
        codec.decode_answer(P.Peers(), {"ok": True, "agents": ["a:1", 5]})
    with pytest.raises(P.ProtocolError, match="data is not base64"):
        codec.decode_answer(P.Output(fd=1, offset=0), {"ok": True, "data": "not base64!"})


def test_lines_are_bounded_and_objects() -> None:
    with pytest.raises(P.ProtocolError, match="over the limit"):
        codec.parse_line(b"{" + b" " * P.LINE_MAX + b"}\n")
    with pytest.raises(P.ProtocolError, match="over the limit"):
        codec.parse_line(b'{"op": "where"}')  # (no end of line: cut short)
    with pytest.raises(P.ProtocolError, match="not a JSON object"):
        codec.parse_line(b"[1, 2]\n")
    with pytest.raises(P.ProtocolError, match="over the limit"):
        codec.request_line(1, P.End(why="x" * P.LINE_MAX))


def test_a_grpc_rank_request_is_checked_before_it_is_passed_on() -> None:
    empty = rankwire.request_pb("job", 0, P.Where(), 5.0)
    empty.ClearField("where")
    with pytest.raises(Refused, match="must name one operation") as e:
        rankwire.request_of(empty)
    assert e.value.why is Why.INVALID
    with pytest.raises(Refused, match="timeout must be between") as e:
        rankwire.request_of(rankwire.request_pb("job", 0, P.Where(), 0.0))
    with pytest.raises(Refused, match="over the limit") as e:
        rankwire.request_of(rankwire.request_pb("job", 0, P.End(why="x" * P.LINE_MAX), 5.0))
    with pytest.raises(Refused, match="timeout is not a number"):
        rankwire.request_of(rankwire.request_pb("job", 0, P.Boundary(timeout=float("nan")), 5.0))
    with pytest.raises(Refused, match="a rank's own timeout must be between"):
        rankwire.request_of(rankwire.request_pb("job", 0, P.Rebuild(gen=1, timeout=-1.0), 5.0))
    for job, rank in (("j" * (P.JOB_MAX + 1), 0), ("a\nb", 0), ("job", -1), ("", 0)):
        with pytest.raises(Refused, match="must name a job"):
            rankwire.request_of(rankwire.request_pb(job, rank, P.Where(), 5.0))
    assert rankwire.request_of(rankwire.request_pb("", 0, P.Jobs(), 5.0)) == P.Jobs()  # (`tpagent node`: no rank)
    other = rankwire.reply_pb(P.Agents(agents=("a:1",)))
    with pytest.raises(Refused, match="answered 'where' with 'agents'") as e:
        rankwire.answer_of(P.Where(), other)
    assert e.value.why is Why.INTERNAL


def test_the_line_protocols_own_messages_say_their_op() -> None:
    hello = lines.Hello("job", 1, 4, pid=9, gen=2, step=3, backend="gloo")
    body = codec.parse_line(codec.said(hello))
    assert codec.is_said(body, lines.LineOp.HELLO) and not codec.is_said(body, lines.LineOp.EXIT)
    assert codec.decode(lines.Hello, body) == hello
    assert json.loads(codec.said(lines.Exit(3))) == {"op": "exit", "code": 3}
    with pytest.raises(P.ProtocolError, match="Hello lacks world"):
        codec.decode(lines.Hello, {"op": "hello", "job": "j", "rank": 0})


def test_the_job_id_rule_is_one_for_the_stand_in_and_the_runtime() -> None:
    assert P.job_id({}) == "job"
    assert P.job_id({"SLURM_JOB_ID": "77"}) == "77"
    assert P.job_id({"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "t"}) == "t"
    assert P.job_id({"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "t", "TPAGENT_JOB": "mine"}) == "mine"
    assert P.job_id({"TPAGENT_JOB": "", "TORCHELASTIC_RUN_ID": "t"}) == "t"  # (set but empty: not set)
    assert P.valid_job("j" * P.JOB_MAX) and not P.valid_job("j" * (P.JOB_MAX + 1)) and not P.valid_job("a\nb")


def test_every_field_of_a_message_is_on_the_grpc_wire() -> None:
    """The proto's messages mirror the dataclasses field for field (a field added to one side only
    would be dropped silently between agents)."""
    for cls in P.REQUESTS.values():
        message = getattr(rankwire.pb.RankRequest, cls.__name__)
        assert {f.name for f in dataclasses.fields(cls)} == set(message.DESCRIPTOR.fields_by_name), cls
    for answer in ANSWERS[1:]:
        message = getattr(rankwire.pb.RankReply, type(answer).__name__)
        own = {f.name for f in dataclasses.fields(answer)} - {"ok", "error"}
        assert own == set(message.DESCRIPTOR.fields_by_name), type(answer)
    row = rankwire.pb.RankReply.RankRow
    assert {f.name for f in dataclasses.fields(P.RankRow)} == set(row.DESCRIPTOR.fields_by_name)


def test_what_the_first_runtime_said_of_none_still_reads() -> None:
    """A rank started before the protocol was typed says none as null (a where without NCCL, a
    peer that has not said where its agent is): an agent upgraded under its running job still
    reads it, as text that is empty."""
    old_where = {
        "id": 3,
        "ok": True,
        "step": 7,
        "gen": 1,
        "state": "running",
        "rate": 2.0,
        "collective_rate": 0.0,
        "groups": 1,
        "nccl_host": None,
        "nccl_ras": False,
        "host": "h|b",
        "hosts_store": None,
        "store_loopback": None,
    }
    assert codec.decode_answer(P.Where(), old_where) == P.Standing(step=7, gen=1, rate=2.0, groups=1, host="h|b")
    old_peers = {"id": 4, "ok": True, "agents": ["10.0.0.1:7400", None]}
    assert codec.decode_answer(P.Peers(), old_peers).agents == ("10.0.0.1:7400", "")


def test_a_caller_older_than_the_typed_protocol_is_answered_in_its_own_form() -> None:
    """A stand-in started before its node's agent was upgraded (it lives as long as its job) asks
    in JSON: it is checked as every request is, and answered in JSON, as it reads."""
    old = rankwire.pb.RankRequest(
        job="job", rank=1, body=json.dumps({"op": "output", "fd": 2, "offset": 5}), timeout=10
    )
    assert rankwire.legacy(old) and rankwire.request_of(old) == P.Output(fd=2, offset=5)
    reply = rankwire.reply_pb(P.Written(data=b"rank 1 said", size=16), as_json=True)
    assert json.loads(reply.body) == {"ok": True, "error": "", "data": "cmFuayAxIHNhaWQ=", "size": 16}
    assert not rankwire.legacy(rankwire.request_pb("job", 1, P.Locate(), 10.0))
    for body in ('{"op": "drop_tables"}', "[1]", '{"op": "output", "fd": "x", "offset": 0}', "{" * 70000):
        bad = rankwire.pb.RankRequest(job="job", rank=1, body=body, timeout=10)
        with pytest.raises(Refused, match="not one of the rank protocol") as e:
            rankwire.request_of(bad)
        assert e.value.why is Why.INVALID


def test_a_field_protobuf_leaves_at_zero_takes_the_protocols_default() -> None:
    """Protobuf cannot tell a field left unset from its zero: a caller that sets only what it means
    gets the protocol's defaults, not zeros (a pause in no unit, reads of one byte)."""
    bare = rankwire.pb.RankRequest(job="job", rank=0, timeout=5, pause=rankwire.pb.RankRequest.Pause(at=9))
    assert rankwire.request_of(bare) == P.Pause(at=9, unit="step")
    bare = rankwire.pb.RankRequest(job="job", rank=0, timeout=5, output=rankwire.pb.RankRequest.Output(fd=1))
    assert rankwire.request_of(bare) == P.Output(fd=1, offset=0, max=P.OUTPUT_MAX)


class _Store:
    """A job's store as the runtime sees it (its address, compare-and-set), holding ``agreed``."""

    def __init__(self, host: str, port: int, agreed: str = "") -> None:
        self.host = host
        self.port = port
        self.agreed = agreed

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        assert key == P.JOB_KEY and expected == ""
        self.agreed = self.agreed or desired
        return self.agreed.encode()


def test_a_jobs_key_is_agreed_once_and_bound_to_its_stores_address() -> None:
    from tpagent_rank.agent import Rank

    def key(store: _Store) -> str | None:
        return Rank("job", 0, 2, store, None, "s")._job_key()

    store = _Store("10.0.0.1", 29500)
    first = key(store)
    assert first and key(store) == first  # (every rank of the job: the value the first put there)
    # Another job's store, given this one's value by whoever can write it: still another job.
    assert key(_Store("10.0.0.2", 29500, store.agreed)) != first
    assert key(_Store("10.0.0.1", 29501, store.agreed)) != first
    assert key(_Store("10.0.0.1", 29500)) != first  # (a fresh job on the same address)
