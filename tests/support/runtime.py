"""The rank runtime as `tpagent rank` gives it to a training process, for the rank tier's jobs:
its directory on the process's PYTHONPATH (before what the caller has there: as nobody, that is
how torch is found), and no TPAGENT_* of the caller's."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any, TypeVar

from tpagent_rank import codec, lines
from tpagent_rank import protocol as P
from tpagent_rank.layout import write_runtime_dir

A = TypeVar("A", bound=P.Answer)


def runtime_env(tmp: Path, *before: Path, **extra: str) -> dict[str, str]:
    """This process's environment with the runtime (written once, at ``tmp``/runtime) first on
    PYTHONPATH, then ``before``, then the caller's; ``extra`` set (TPAGENT_RANK_SOCKET turns the
    runtime on)."""
    runtime = tmp / "runtime"
    if not runtime.exists():
        runtime.mkdir()
        write_runtime_dir(runtime)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPAGENT_")}
    path = [str(runtime), *map(str, before), base.get("PYTHONPATH", "")]
    return {**base, "PYTHONPATH": os.pathsep.join(filter(None, path)), **extra}


def ask_all(agents: list[PlayedAgent], request: P.Request[Any]) -> list[P.Answer]:
    """``request`` asked of every one at once (a rebuild waits for its peers)."""
    answers: list[P.Answer] = [P.failed("no answer")] * len(agents)

    def one(i: int) -> None:
        try:
            answers[i] = agents[i].ask(request)
        except (OSError, P.ProtocolError) as e:
            answers[i] = P.failed(f"its connection failed: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return answers


class PlayedAgent:
    """A rank's agent, as far as the runtime sees one (the test plays it): it listens on the
    rank's socket name, welcomes the rank's hello, then asks; a saved state is read after its
    answer's line, a state to load is sent after its request's line."""

    def __init__(self, name: str, timeout: float = 120.0) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + name)
        self.listener.listen()
        self.listener.settimeout(timeout)
        self.timeout = timeout
        self.conn: socket.socket | None = None
        self.hello: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.rid = 0

    def welcome(self) -> dict[str, Any]:
        """The rank's next connection, welcomed (one before it is closed: a rank restarted in its
        own process connects again)."""
        if self.conn is not None:
            self.f.close()
            self.conn.close()
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(self.timeout)
        self.f = self.conn.makefile("rb")
        self.hello = codec.parse_line(self.f.readline())
        assert codec.is_said(self.hello, lines.LineOp.HELLO), self.hello
        self.conn.sendall(codec.said(lines.Welcome(node="10.0.0.1:7400")))
        return self.hello

    def ask(self, request: P.Request[A], payload: bytes = b"") -> A:
        return self.asked(request, payload)[0]

    def asked(self, request: P.Request[A], payload: bytes = b"") -> tuple[A, bytes]:
        """The answer, and the bytes that follow its line (a saved state's)."""
        assert self.conn is not None
        with self.lock:
            self.rid += 1
            self.conn.sendall(codec.request_line(self.rid, request) + payload)
            while True:
                body = codec.parse_line(self.f.readline())
                if body.get("id") == self.rid:
                    answer = codec.decode_answer(request, body)
                    follows = isinstance(answer, P.Saved) and answer.ok and not answer.port
                    tail = self.f.read(answer.size) if follows else b""
                    return answer, tail

    def close(self) -> None:
        if self.conn is not None:
            self.f.close()
            self.conn.close()
        self.listener.close()
