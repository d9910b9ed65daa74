"""One rank's connection to its node's agent (:mod:`tpagent.jobs.ranks` accepts it): the agent's
requests written under a lock, each answer matched to its request by id and decoded as the
rank protocol's answer to it (:mod:`tpagent_rank.codec`)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any, TypeVar

from host import peers
from tpagent.migration.api import AgentError
from tpagent_rank import codec, lines
from tpagent_rank import protocol as P

A = TypeVar("A", bound=P.Answer)
#: Seconds a write to a rank may wait for it to read (its buffer full) before its connection is closed.
SEND_WITHIN = 10


class RankGone(AgentError):
    """The rank's connection broke (or it never came) while the agent asked it something."""


class Connection:
    """One rank's connection: requests written under a lock, answers matched by id."""

    def __init__(self, sock: socket.socket, peer: peers.Peer, hello: lines.Hello) -> None:
        # A rank that reads nothing holds no sender (and the lock, every other call) past this.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_WITHIN, 0))
        self.sock = sock
        self.peer = peer  # (its pidfd is closed with the connection)
        self.hello = hello
        self.lock = threading.RLock()  # (held across its welcome: Ranks._admit)
        self.next_id = 1
        self.waiting: dict[int, list[Any]] = {}  # id -> [Event, its answer's fields]
        self.closed = threading.Event()

    def send(self, data: bytes) -> None:
        """``data`` written whole, or the connection closed (a line cut short ends its stream)."""
        with self.lock:
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()
                raise

    def call(self, request: P.Request[A], timeout: float) -> A:
        slot: list[Any] = [threading.Event(), None]
        with self.lock:
            rid = self.next_id
            self.next_id += 1
            self.waiting[rid] = slot
        try:
            self.send(codec.request_line(rid, request))
            if not slot[0].wait(timeout):
                raise RankGone(f"it did not answer {request.OP.value!r} within {timeout:.0f} s")
            if slot[1] is None:
                raise RankGone("its connection to this agent closed")
            return codec.decode_answer(request, slot[1])
        except P.ProtocolError as e:
            raise RankGone(f"its answer to {request.OP.value!r} is not one of the rank protocol ({e})") from e
        except OSError as e:
            raise RankGone(f"its connection to this agent broke ({e.strerror or e})") from e
        finally:
            with self.lock:
                self.waiting.pop(rid, None)

    def answered(self, body: dict[str, Any]) -> None:
        rid = body.get("id")
        with self.lock:
            slot = self.waiting.get(rid) if isinstance(rid, int) else None
        if slot is not None:
            slot[1] = body
            slot[0].set()

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # (its reader, blocked in a read, returns; a send fails)
        with self.lock:  # (its descriptor is never closed under a send, to be taken by another's)
            with contextlib.suppress(OSError):
                self.sock.close()
            self.peer.close()
            for slot in self.waiting.values():
                slot[0].set()
