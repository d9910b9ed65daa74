"""tpagent_rank, as a user's training process will load it: from a directory holding only it,
in an interpreter without our environment, it brings in nothing but the standard library."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Our packages (generic names that would shadow a user's) and our dependencies.
OURS = {
    "snapshot",
    "transfer",
    "cli",
    "tpagent",
    "grpc",
    "grpc_health",
    "google",
    "psutil",
    "zstandard",
    "typer",
    "prometheus_client",
    "pynvml",
    "cuda",
    "ucxx",
    "numpy",
    "torch",
}

PROBE = textwrap.dedent(
    """
    import json, sys
    before = set(sys.modules)
    sys.path.insert(0, sys.argv[1])
    import tpagent_rank
    print(json.dumps({
        "new": sorted(set(sys.modules) - before),
        "stdlib": sorted(sys.stdlib_module_names),
        "file": tpagent_rank.__file__,
        "version": tpagent_rank.__version__,
    }))
    """
)


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What importing a copy of tpagent_rank did, alone on sys.path."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "tpagent_rank", site / "tpagent_rank", ignore=shutil.ignore_patterns("__pycache__"))
    # -I: no PYTHONPATH, no user site, not the current directory; -S: no site-packages.
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", PROBE, str(site)],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout), "site": str(site)}


def test_importing_it_alone_brings_only_the_standard_library(seen: dict[str, Any]) -> None:
    assert Path(seen["file"]) == Path(seen["site"]) / "tpagent_rank" / "__init__.py"
    tops = {name.split(".")[0] for name in seen["new"]}
    assert "tpagent_rank" in tops
    assert not tops & OURS
    assert tops - {"tpagent_rank"} <= set(seen["stdlib"])


def test_its_version_is_the_distributions(seen: dict[str, Any]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert seen["version"] == project["version"]
