"""The agent's gRPC API: ``agent.proto``, compiled into ``agent_pb2*.py`` next to it.

The generated modules (and their typed ``.pyi`` stubs, from mypy-protobuf) are not kept in git:
installing or building the package writes them (setup.py's build hook, with the protoc of
grpcio-tools from [build-system] in pyproject.toml).  After editing the .proto in an editable
install, ``python -m tpagent.daemon.proto`` (needs grpcio-tools and mypy-protobuf) writes them again.
Nothing is compiled at import: without them, importing ``agent_pb2`` raises ImportError."""
