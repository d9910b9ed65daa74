"""The rank protocol (:mod:`tpagent_rank.protocol`) on the agents' gRPC ``Rank`` call: each of its
request and answer dataclasses to and from the protobuf message of the same name and fields
(``RankRequest.<Request>``, in the oneof ``op`` under the op's name; ``RankReply.<Answer>``, in the
oneof ``answer`` under the answer's name in snake case, ``ok`` and ``error`` beside it)."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, TypeVar

from google.protobuf.message import Message

from tpagent.daemon.rpc import pb
from tpagent.migration.api import Refused, Why
from tpagent_rank import codec
from tpagent_rank import protocol as P

A = TypeVar("A", bound=P.Answer)
M = TypeVar("M", bound=Message)
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
        values[f.name] = value
    return cls(**values)


def request_pb(job: str, rank: int, request: P.Request[Any], timeout: float) -> pb.RankRequest:
    message = _to_pb(request, getattr(pb.RankRequest, type(request).__name__))
    return pb.RankRequest(job=job, rank=rank, timeout=timeout, **{request.OP.value: message})


def request_of(message: pb.RankRequest) -> P.Request[Any]:
    """The request a Rank call carries; Refused (INVALID) for one that is not valid."""
    kind = message.WhichOneof("op")
    if kind is None:
        raise Refused("a Rank request must name one operation of the rank protocol.", Why.INVALID)
    request: P.Request[Any] = _from_pb(getattr(message, kind), P.REQUESTS[P.Op(kind)])
    if not 0 < message.timeout <= TIMEOUT_MAX:
        raise Refused(f"a Rank request's timeout must be between 0 and {TIMEOUT_MAX:.0f} s.", Why.INVALID)
    try:
        codec.request_line(0, request)  # (what a rank is passed must fit its line)
    except P.ProtocolError as e:
        raise Refused(f"a Rank request must fit in {P.LINE_MAX} bytes ({e}).", Why.INVALID) from e
    return request


def reply_pb(answer: P.Answer) -> pb.RankReply:
    if type(answer) is P.Answer:
        return pb.RankReply(ok=answer.ok, error=answer.error)
    name = type(answer).__name__
    message = _to_pb(answer, getattr(pb.RankReply, name))
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
