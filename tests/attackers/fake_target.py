"""An impostor: answers every call of the agent API with NOT_FOUND, which a source agent
once took as "the target's copy is gone" (and then resumed its original: two copies).

    python fake_target.py HOST:PORT CERT_DIR

CERT_DIR: the impostor's own certificate (another CA's, or the cluster CA's for another
name).  Prints "listening" once it serves, then serves until killed.
"""

from __future__ import annotations

import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

address = sys.argv[1]
cert_dir = Path(sys.argv[2])


class Anything(grpc.GenericRpcHandler):  # type: ignore[misc]
    def service(self, details: Any) -> Any:
        def gone(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such migration here")
            return b""

        return grpc.unary_unary_rpc_method_handler(gone)


server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[Anything()])
key = (cert_dir / "tls.key").read_bytes()
cert = (cert_dir / "tls.crt").read_bytes()
server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
server.start()
print("listening", flush=True)
threading.Event().wait()
