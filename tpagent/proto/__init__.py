"""The agent's gRPC API: ``agent.proto``, compiled into ``agent_pb2*.py`` next to it.

The generated modules are not kept in git: ``python -m tpagent.proto`` (run by
scripts/setup.sh and the Dockerfile at install) writes them, and :func:`load` writes them
again when they are missing or older than the .proto."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
PROTO = HERE / "agent.proto"
OUTPUTS = [HERE / "agent_pb2.py", HERE / "agent_pb2.pyi", HERE / "agent_pb2_grpc.py"]


def compile_proto() -> None:
    from grpc_tools import protoc

    root = HERE.parent.parent
    rel = PROTO.relative_to(root)
    args = ["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}", f"--grpc_python_out={root}", str(rel)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


def load() -> tuple[ModuleType, ModuleType]:
    """agent_pb2 and agent_pb2_grpc, compiled first if they are missing or stale."""
    if any(not p.exists() or p.stat().st_mtime < PROTO.stat().st_mtime for p in OUTPUTS):
        compile_proto()
    return importlib.import_module("tpagent.proto.agent_pb2"), importlib.import_module("tpagent.proto.agent_pb2_grpc")
