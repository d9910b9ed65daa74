"""``python -m tpagent.daemon.proto``: compile agent.proto again into this package's directory."""

from pathlib import Path

from tpagent.daemon.proto._build import compile_proto

root = Path(__file__).resolve().parents[3]  # where tpagent/ lies: agent.proto's import root
for path in compile_proto(root, root):
    print(path)
