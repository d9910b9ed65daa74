"""The rank protocol's encoding (:mod:`tpagent_rank.protocol` says what is sent): its messages as
the line protocol's lines, and the checked decoding of whatever arrives, on either wire.

Standard library only, as the protocol is (it is loaded into users' training processes)."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from tpagent_rank.lines import Broke, Exit, Hello, LineOp, Refusal, Stepped, Welcome
from tpagent_rank.protocol import LINE_MAX, REQUESTS, A, Op, ProtocolError, Request

T = TypeVar("T")
#: The integers either wire carries (protobuf's int64).
INT_MIN = -(1 << 63)
INT_MAX = (1 << 63) - 1


def said(message: Hello | Welcome | Refusal | Exit | Broke | Stepped) -> bytes:
    """One of the line protocol's own messages, as a line."""
    return line(message, op=message.OP.value)


def is_said(body: Mapping[str, Any], op: LineOp) -> bool:
    """Whether a line read is the message ``op``."""
    return body.get("op") == op.value


def _json(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def fields_of(message: Any) -> dict[str, Any]:
    """A message's fields as JSON values (bytes as base64 text)."""
    out: dict[str, Any] = _json(message)
    return out


def line(message: Any, **head: Any) -> bytes:
    """One line of the line protocol: ``head`` (its ``id``, its ``op``) then the message's fields."""
    data = json.dumps({**head, **fields_of(message)}).encode() + b"\n"
    if len(data) > LINE_MAX:
        raise ProtocolError(f"a line of {len(data)} bytes, over the limit of {LINE_MAX}")
    return data


def request_line(rid: int, request: Request[Any]) -> bytes:
    return line(request, id=rid, op=request.OP.value)


def parse_line(data: bytes) -> dict[str, Any]:
    """A line as read (with its newline): one JSON object, within :data:`LINE_MAX`."""
    if len(data) > LINE_MAX or not data.endswith(b"\n"):
        raise ProtocolError("a line over the limit")
    try:
        body = json.loads(data)
    except ValueError as e:
        raise ProtocolError(f"a line that is not JSON ({e})") from e
    except RecursionError as e:  # (arrays in arrays, thousands deep: well within a line's bytes)
        raise ProtocolError("a line nested deeper than JSON is read here") from e
    if not isinstance(body, dict):
        raise ProtocolError("a line that is not a JSON object")
    return body


def _check(kind: Any, value: Any, name: str) -> Any:
    """``value`` (JSON) as the annotated ``kind``, or ProtocolError."""
    origin = typing.get_origin(kind)
    if origin is tuple:
        item = typing.get_args(kind)[0]
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{name} is not a list")
        return tuple(_check(item, v, f"{name}[]") for v in value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{name} is not true or false")
        return value
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool) or not INT_MIN <= value <= INT_MAX:
            raise ProtocolError(f"{name} is not an integer of 64 bits")
        return value
    if kind is float:
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise ProtocolError(f"{name} is not a number")
        return float(value)
    if kind is str:
        if value is None:  # (how the first runtime said "none": ranks started before the typed protocol)
            return ""
        if not isinstance(value, str):
            raise ProtocolError(f"{name} is not text")
        try:
            value.encode()
        except UnicodeEncodeError as e:  # (JSON's "\\udc80" is read as a lone surrogate: no text)
            raise ProtocolError(f"{name} is not text in UTF-8") from e
        return value
    if kind is bytes:
        if isinstance(value, bytes):
            return value
        try:
            return base64.b64decode(str(value), validate=True)
        except ValueError as e:
            raise ProtocolError(f"{name} is not base64") from e
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, Mapping):
            raise ProtocolError(f"{name} is not an object")
        return decode(typing.cast(type[Any], kind), value)
    raise TypeError(f"{name}: {kind!r} is no type of this protocol")  # (a bug here, not the peer's)


_TYPES: dict[type[Any], dict[str, Any]] = {}


def types_of(cls: type[Any]) -> dict[str, Any]:
    """A message class's fields and their types (resolved once)."""
    if cls not in _TYPES:
        _TYPES[cls] = typing.get_type_hints(cls)
    return _TYPES[cls]


def decode(cls: type[T], data: Mapping[str, Any]) -> T:
    """A ``cls`` from its fields in ``data`` (others are ignored), each checked against its type;
    a field that is missing takes its default (ProtocolError if it has none)."""
    hints = types_of(cls)
    kwargs = {}
    for f in dataclasses.fields(typing.cast(Any, cls)):
        if f.name in data:
            kwargs[f.name] = _check(hints[f.name], data[f.name], f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{cls.__name__} lacks {f.name}")
    return cls(**kwargs)


def decode_request(data: Mapping[str, Any]) -> Request[Any]:
    """The request a line (or a peer's message) holds, by its ``op``."""
    try:
        op = Op(data.get("op"))
    except ValueError as e:
        raise ProtocolError(f"{str(data.get('op'))[:40]!r} is not an operation of the rank protocol") from e
    return decode(REQUESTS[op], data)


def decode_answer(request: Request[A], data: Mapping[str, Any]) -> A:
    """The answer to ``request`` that ``data`` holds."""
    return typing.cast(A, decode(request.ANSWER, data))
