"""Build hook: compiles tpagent/daemon/proto/agent.proto whenever the package is built or installed
(the generated modules are not kept in git).  Everything else is in pyproject.toml."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _proto_build() -> ModuleType:
    # Loaded by path: importing tpagent.daemon.proto would run the package's __init__ files at build time.
    spec = importlib.util.spec_from_file_location(
        "_tpagent_proto_build", ROOT / "tpagent" / "daemon" / "proto" / "_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProto(build_py):
    def run(self) -> None:
        super().run()  # first: it would copy stale generated .py files over fresh ones
        # Editable installs import from the source tree, so the modules go there; a wheel gets
        # them in its build directory.
        out_root = ROOT if self.editable_mode else Path(self.build_lib)
        _proto_build().compile_proto(ROOT, out_root)


setup(cmdclass={"build_py": BuildPyWithProto})
