"""scripts/check_layers.py on small synthetic trees: it finds cycles, upward imports and
tpagent_rank's forbidden imports, wherever the import statement stands."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_layers.py"


@pytest.fixture(scope="module")
def check_layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def _run(check_layers: ModuleType, root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], list[str]]:
    code = check_layers.main([str(root)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


LAYERS = """\
[tool.tpagent.layers]
order = ["snapshot", "transfer", "tpagent", "tpagent.daemon", "cli"]
beside = "tpagent_rank"
"""
ORDER = "(snapshot < transfer < tpagent < tpagent.daemon < cli)"

CLEAN = {
    "pyproject.toml": LAYERS,
    "snapshot/__init__.py": "from snapshot.api import SnapshotError\n",
    "snapshot/api.py": "class SnapshotError(Exception): ...\n",
    "transfer/__init__.py": "",
    "transfer/wire.py": "from snapshot import api\nfrom . import stream\n",
    "transfer/stream.py": "import zlib\n",
    "tpagent/__init__.py": "",
    "tpagent/daemon/rpc.py": "import grpc\nfrom transfer.wire import x\nfrom snapshot.api import SnapshotError\n",
    "tpagent/daemon/proto/__init__.py": "",
    "tpagent/daemon/proto/agent_pb2.py": "from cli import main  # generated: not ours, not read\n",
    "cli/main.py": "import tpagent.daemon.rpc\nimport snapshot\n"
    + "x = 1  # "
    + "." * 111
    + "\n"
    + "y = 2  # "
    + "." * 112
    + "\n",
    "tpagent_rank/__init__.py": '''\
        """Runs in users' processes."""
        from __future__ import annotations
        import os, threading
        from . import hooks

        def on_fault() -> None:
            import torch
        ''',
    "tpagent_rank/hooks.py": "import signal\n",
}


def test_a_clean_tree_passes_and_is_summarised(
    check_layers: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(check_layers, _tree(tmp_path, CLEAN), capsys)
    assert (code, err) == (0, [])
    assert out[0] == (
        "modules: 11 (snapshot 2, transfer 3, tpagent 1, tpagent.daemon 2, cli 1, tpagent_rank 2), 20 lines"
    )
    assert out[1] == (
        "imports between them: 8 edges; between layers: cli -> snapshot 1, cli -> tpagent.daemon 1, "
        "tpagent.daemon -> snapshot 1, tpagent.daemon -> transfer 1, transfer -> snapshot 1"
    )
    assert out[2] == "largest module: tpagent_rank/__init__.py, 7 lines"
    assert out[3] == "longest function: tpagent_rank/__init__.py:6 on_fault, 2 lines"
    assert out[4] == "lines over 120 characters: 1 in 1 files (most: cli/main.py 1)"


def _long_function(lines: int, said: str = "") -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    return f"def f() -> None:{said}\n{body}"


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        (
            {"transfer/big.py": "x = 1\n" * 501},
            "transfer/big.py: 501 lines, over 500: split it along a real seam",
        ),
        (
            {"snapshot/dump.py": _long_function(81)},
            "snapshot/dump.py:1: f is 81 lines, over 80: make it named steps, or say why on its def line (# long: ...)",
        ),
        (
            {"cli/main.py": "a = b = 0\nb, c = a + 1, a + 2  # two\n"},
            "cli/main.py:2: several assignments on one line: one per line",
        ),
    ],
    ids=["module", "function", "packed"],
)
def test_the_code_keeps_its_shape(
    check_layers: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], files: dict[str, str], problem: str
) -> None:
    code, _, err = _run(check_layers, _tree(tmp_path, CLEAN | files), capsys)
    assert (code, err) == (1, [problem])


def test_what_keeps_its_shape_passes(
    check_layers: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """500 lines, 80 lines, a long function that says why, a swap and a call's result unpacked."""
    files = {
        "transfer/big.py": "x = 1\n" * 500,
        "snapshot/dump.py": _long_function(80),
        "snapshot/hook.py": _long_function(120, "  # long: one table, row by row"),
        "cli/main.py": "a, b = 1, 2\nb, a = a, b\nq, r = divmod(7, 2)\n".replace("a, b = 1, 2", "a = 1\nb = 2"),
    }
    code, _, err = _run(check_layers, _tree(tmp_path, CLEAN | files), capsys)
    assert (code, err) == (0, [])


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        (
            {"snapshot/a.py": "from snapshot import b\n", "snapshot/b.py": "import snapshot.a\n"},
            "cycle: snapshot.a -> snapshot.b -> snapshot.a (snapshot/a.py:1, snapshot/b.py:1)",
        ),
        (
            {
                "tpagent/agent.py": "from tpagent import peer\n",
                "tpagent/peer.py": "import typing\nif typing.TYPE_CHECKING:\n    from tpagent.agent import Agent\n",
            },
            "cycle: tpagent.agent -> tpagent.peer -> tpagent.agent (tpagent/agent.py:1, tpagent/peer.py:3)",
        ),
        (
            {
                "transfer/__init__.py": "",
                "transfer/a.py": "def f():\n    from . import b\n",
                "transfer/b.py": "from .c import g\n",
                "transfer/c.py": "from transfer.a import f\nfrom transfer.d import h\n",
                "transfer/d.py": "from .b import x\n",
            },
            "cycle: transfer.a -> transfer.b -> transfer.c -> transfer.a (transfer/a.py:2, transfer/b.py:1, "
            "transfer/c.py:1); tied into it too: transfer.d",
        ),
        (
            {"snapshot/restore.py": "import os\n\ndef f():\n    import cli.main\n"},
            f"snapshot/restore.py:4: snapshot.restore imports cli.main: snapshot imports cli, a layer above it {ORDER}",
        ),
        (
            {"transfer/sender.py": "from tpagent import __version__\n"},
            "transfer/sender.py:1: transfer.sender imports tpagent.__version__: transfer imports tpagent, a layer "
            f"above it {ORDER}",
        ),
        (
            {"tpagent/version.py": "def f():\n    from tpagent.daemon import rpc\n"},
            "tpagent/version.py:2: tpagent.version imports tpagent.daemon.rpc: tpagent imports tpagent.daemon, a "
            f"layer above it {ORDER}",
        ),
        (
            {"tpagent/daemon/node.py": "import tpagent_rank.backend\n", "tpagent_rank/backend.py": "import torch\n"},
            "tpagent/daemon/node.py:1: tpagent.daemon.node imports tpagent_rank.backend (which needs torch) at import "
            "time: import it inside the function that needs it",
        ),
        (
            {"tpagent_rank/__init__.py": "from snapshot.api import SnapshotError\n"},
            "tpagent_rank/__init__.py:1: tpagent_rank imports snapshot.api.SnapshotError: tpagent_rank runs in "
            "users' processes and imports nothing of cli, snapshot, tpagent, transfer",
        ),
        (
            {"tpagent_rank/net.py": "def f():\n    import grpc\n"},
            "tpagent_rank/net.py:2: tpagent_rank.net imports grpc: tpagent_rank imports only the standard library "
            "and torch",
        ),
        (
            {"tpagent_rank/__init__.py": "import importlib\nimportlib.import_module('transfer.wire')\n"},
            "tpagent_rank/__init__.py:2: tpagent_rank imports transfer.wire: tpagent_rank runs in users' processes "
            "and imports nothing of cli, snapshot, tpagent, transfer",
        ),
        (
            {"tpagent_rank/__init__.py": "import torch.distributed\n"},
            "tpagent_rank/__init__.py:1: tpagent_rank imports torch.distributed at import time: importing "
            "tpagent_rank must not import torch",
        ),
        (
            {"tpagent_rank/b.py": "import torch\n", "tpagent_rank/a.py": "import tpagent_rank.b\n"},
            "tpagent_rank/a.py:1: tpagent_rank.a imports tpagent_rank.b (which needs torch) at import time: import "
            "it inside the function that needs it",
        ),
        (
            {"snapshot/a.py": "from ... import x\n"},
            "snapshot/a.py:1: a relative import goes above the top-level package",
        ),
        (
            {"cli/main.py": "def f(:\n"},
            "cli/main.py:1: cannot be parsed: invalid syntax",
        ),
    ],
    ids=[
        "cycle",
        "cycle-under-TYPE_CHECKING",
        "relative-cycle-in-a-function",
        "upward-in-a-function",
        "upward-from-import",
        "upward-between-subpackages",
        "torch-bound-rank-module-eagerly",
        "rank-imports-a-layer",
        "rank-imports-a-dependency",
        "rank-import_module",
        "rank-torch-at-import",
        "rank-imports-torch-bound-eagerly",
        "relative-too-high",
        "syntax-error",
    ],
)
def test_a_problem_is_reported_on_one_line(
    check_layers: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], files: dict[str, str], problem: str
) -> None:
    code, _, err = _run(check_layers, _tree(tmp_path, CLEAN | files), capsys)
    assert (code, err) == (1, [problem])


def test_a_missing_root_is_a_usage_error(
    check_layers: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check_layers.main([str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert check_layers.main(["a", "b"]) == 2


def test_a_tree_without_its_layers_is_a_usage_error(
    check_layers: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {k: v for k, v in CLEAN.items() if k != "pyproject.toml"}
    assert check_layers.main([str(_tree(tmp_path, files))]) == 2
    assert "has no [tool.tpagent.layers]" in capsys.readouterr().err
    (tmp_path / "pyproject.toml").write_text(LAYERS.replace('"tpagent", "tpagent.daemon"', '"tpagent", "tpagent"'))
    assert check_layers.main([str(tmp_path)]) == 2
    assert "names a layer twice" in capsys.readouterr().err


def test_the_repository_order_is_its_own() -> None:
    """The order check_layers reads for this repository holds every package, each once."""
    spec = importlib.util.spec_from_file_location("check_layers_repo", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layers_repo"] = module
    spec.loader.exec_module(module)
    layers = module.read_layers(SCRIPT.parents[1])
    assert layers.packages == ("host", "snapshot", "transfer", "tpagent", "cli", "tpagent_rank")
    assert (
        layers.order.index("tpagent.migration")
        < layers.order.index("tpagent.jobs")
        < layers.order.index("tpagent.daemon")
    )
