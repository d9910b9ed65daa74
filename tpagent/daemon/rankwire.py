"""The rank protocol (:mod:`tpagent_rank.protocol`) on the agents' gRPC ``Rank`` call: each of its
request and answer dataclasses to and from the protobuf message of the same name and fields
(``RankRequest.<Request>``, in the oneof ``op`` under the op's name; ``RankReply.<Answer>``, in the
oneof ``answer`` under the answer's name in snake case, ``ok`` and ``error`` beside it)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from tpagent.daemon.rpc import pb
from tpagent.migration.api import Refused, Why
from tpagent_rank import codec
from tpagent_rank import protocol as P

A = TypeVar("A", bound=P.Answer)
M = TypeVar("M", bound=Message)
#: A byte that is no UTF-8, as Python reads such bytes (``os.fsdecode``).
_ESCAPED = re.compile("[\udc80-\udcff]")
#: The largest timeout a Rank call may ask the agent to wait for its rank.
TIMEOUT_MAX = 3600.0


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _to_pb(obj: Any, message: type[M]) -> M:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name in ("ok", "error"):
            continue
        value = getattr(obj, f.name)
        if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            nested = getattr(pb.RankReply, type(value[0]).__name__)
            value = [_to_pb(item, nested) for item in value]
        values[f.name] = value
    return message(**values)


def _from_pb(message: Any, cls: type[Any], **given: Any) -> Any:
    """A ``cls`` from the message of its name.  Protobuf cannot tell a field left unset from its
    zero: a field that reads zero takes the dataclass's default (``unit`` "step", ``max`` 1 MiB)."""
    types = codec.types_of(cls)
    values = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in given:
            continue
        value = getattr(message, f.name)
        if typing.get_origin(types[f.name]) is tuple:
            item = typing.get_args(types[f.name])[0]
            nested = typing.cast(type[Any], item)
            value = tuple(_from_pb(x, nested) if dataclasses.is_dataclass(nested) else x for x in value)
        elif not value and f.default is not dataclasses.MISSING:
            value = f.default
        values[f.name] = value
    return cls(**values)


def request_pb(job: str, rank: int, request: P.Request[Any], timeout: float, key: str = "") -> pb.RankRequest:
    if isinstance(request, P.Join):
        request = _portable(request)
    message = _to_pb(request, getattr(pb.RankRequest, type(request).__name__))
    return pb.RankRequest(job=job, rank=rank, timeout=timeout, job_key=key, **{request.OP.value: message})


def _portable(join: P.Join) -> P.Join:
    """``join`` as protobuf's strings (UTF-8) carry it: where a command, an environment or a path
    is no UTF-8 (read from ``/proc``, its bytes as surrogate escapes), every text as its bytes, a
    character each (``latin1``); else as it is (as an agent older than ``latin1`` reads it)."""
    texts = (*join.cmd, *join.env, join.cwd, join.stdout, join.stderr)
    if join.latin1 or not any(map(_ESCAPED.search, texts)):
        return join
    return _each(join, lambda t: os.fsencode(t).decode("latin-1"), latin1=True)


def _native(join: P.Join) -> P.Join:
    """``join`` as :func:`_portable` sent it (ValueError for a text that is no bytes)."""
    return _each(join, lambda t: os.fsdecode(t.encode("latin-1")), latin1=False) if join.latin1 else join


def _each(join: P.Join, text: Callable[[str], str], latin1: bool) -> P.Join:
    return dataclasses.replace(
        join,
        cmd=tuple(map(text, join.cmd)),
        env=tuple(map(text, join.env)),
        cwd=text(join.cwd),
        stdout=text(join.stdout),
        stderr=text(join.stderr),
        latin1=latin1,
    )


def request_of(message: pb.RankRequest) -> P.Request[Any]:
    """The request a Rank call carries, every field checked as the rank's line checks it (its
    type, 64-bit integers, finite numbers, the line's size), its job, rank and timeouts bounded;
    Refused (INVALID) for one that is not valid.  A caller older than the typed protocol sends
    its request as JSON in ``body`` (:func:`legacy`)."""
    kind = message.WhichOneof("op")
    if kind is None and not message.body:
        raise Refused("a Rank request must name one operation of the rank protocol.", Why.INVALID)
    if not 0 < message.timeout <= TIMEOUT_MAX:
        raise Refused(f"a Rank request's timeout must be between 0 and {TIMEOUT_MAX:.0f} s.", Why.INVALID)
    try:
        if kind is None:
            data = json.loads(message.body) if len(message.body) <= P.LINE_MAX else None
            if not isinstance(data, dict):
                raise P.ProtocolError(f"its body is not one JSON object of at most {P.LINE_MAX} bytes")
        else:
            given = _from_pb(getattr(message, kind), P.REQUESTS[P.Op(kind)])
            data = {**codec.parse_line(codec.request_line(0, given)), "op": kind}
        request = codec.decode_request(data)  # (NaN, a 64-bit overflow, a line too long: refused here)
        if isinstance(request, P.Join):
            request = _native(request)
    except (P.ProtocolError, ValueError) as e:
        raise Refused(f"a Rank request is not one of the rank protocol ({e}).", Why.INVALID) from e
    names_a_rank = not isinstance(request, P.Jobs)  # (every rank of the node: none named)
    if names_a_rank and (not P.valid_job(message.job) or not 0 <= message.rank < P.RANK_MAX):
        raise Refused("a Rank request must name a job (printable, at most 200 characters) and a rank.", Why.INVALID)
    if not 0 < getattr(request, "timeout", 1.0) <= TIMEOUT_MAX:
        raise Refused(f"a rank's own timeout must be between 0 and {TIMEOUT_MAX:.0f} s.", Why.INVALID)
    return request


def legacy(message: pb.RankRequest) -> bool:
    """Whether a Rank request comes from a caller older than the typed protocol (a stand-in that
    started before its node's agent was upgraded): answer it in ``RankReply.body``, as JSON."""
    return message.WhichOneof("op") is None and bool(message.body)


def reply_pb(answer: P.Answer, as_json: bool = False) -> pb.RankReply:
    """The reply that carries ``answer`` (``as_json``: to a caller older than the typed protocol)."""
    if as_json:
        return pb.RankReply(body=json.dumps(codec.fields_of(answer)))
    if type(answer) is P.Answer:
        return pb.RankReply(ok=answer.ok, error=answer.error)
    name = type(answer).__name__
    try:
        message = _to_pb(answer, getattr(pb.RankReply, name))
    except ValueError as e:  # (an integer past 64 bits: the codec refuses what a rank says so)
        raise Refused(f"the answer cannot be sent ({e})", Why.INTERNAL) from e
    return pb.RankReply(ok=answer.ok, error=answer.error, **{_snake(name): message})


def answer_of(request: P.Request[A], reply: pb.RankReply) -> A:
    """The answer to ``request`` a Rank reply carries (its defaults where it holds none)."""
    cls = request.ANSWER
    kind = reply.WhichOneof("answer")
    if kind is None:
        return typing.cast(A, cls(ok=reply.ok, error=reply.error))
    if kind != _snake(cls.__name__):
        raise Refused(f"the agent answered {request.OP.value!r} with {kind!r}", Why.INTERNAL)
    return typing.cast(A, _from_pb(getattr(reply, kind), cls, ok=reply.ok, error=reply.error))
