"""Compile ``agent.proto`` into ``agent_pb2*.py`` and typed ``agent_pb2*.pyi`` (mypy-protobuf).

Standalone on purpose: setup.py loads this file by path at build time, when neither the tpagent
package nor its runtime dependencies can be imported; only the stdlib, grpc_tools and
mypy_protobuf (the build requirements) may be used here."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
import tempfile
from pathlib import Path

PROTO = (
    "tpagent/daemon/proto/agent.proto"  # relative to the source root: the generated imports name tpagent.daemon.proto
)
PLUGINS = {"protoc-gen-mypy": "main", "protoc-gen-mypy_grpc": "grpc"}  # mypy_protobuf.main's entry points


def compile_proto(source_root: Path, out_root: Path) -> list[Path]:
    """Writes the generated modules under ``out_root``/tpagent/proto/ and returns their paths."""
    # Checked first: a missing plugin module would only show as "protoc failed".
    if importlib.util.find_spec("mypy_protobuf") is None:
        needs = "grpcio-tools and mypy-protobuf (pinned in pyproject.toml's [build-system])"
        raise ModuleNotFoundError(f"compiling agent.proto needs {needs}", name="mypy_protobuf")
    from grpc_tools import protoc

    (out_root / PROTO).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # The plugins run under this interpreter, which has mypy_protobuf: its console scripts
        # may not be on PATH (.venv/bin/python run directly, or pip's isolated build env).
        plugin_args = []
        for name, func in PLUGINS.items():
            script = Path(tmp) / name
            code = f"from mypy_protobuf.main import {func}; {func}()"
            script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)}\n")
            os.chmod(script, 0o755)
            plugin_args.append(f"--plugin={name}={script}")
        args = [
            "protoc",
            f"-I{source_root}",
            *plugin_args,
            f"--python_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"--mypy_out={out_root}",
            f"--mypy_grpc_out={out_root}",
            str(source_root / PROTO),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {source_root / PROTO}")
    out = (out_root / PROTO).parent
    return [out / f"agent_pb2{suffix}" for suffix in (".py", ".pyi", "_grpc.py", "_grpc.pyi")]
