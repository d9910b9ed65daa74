"""The directory a stand-in puts on a rank's PYTHONPATH: this package's modules and a
``sitecustomize.py``, nothing else (whatever is there can shadow a user's module)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SITECUSTOMIZE = '''\
"""tpagent's rank runtime (tpagent_rank), then the environment's own sitecustomize, if any."""
import importlib.util as _u
import os as _os
import sys as _sys

if _os.environ.get("TPAGENT_RANK_SOCKET"):
    try:
        import tpagent_rank.boot  # noqa: F401
    except Exception as _e:  # never in the way of the user's program
        print("tpagent_rank: not loaded:", _e, file=_sys.stderr)
_here = _os.path.dirname(_os.path.abspath(__file__))
_path = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
for _p in _path:
    _spec = _u.spec_from_file_location("sitecustomize", _os.path.join(_p or ".", "sitecustomize.py"))
    if _spec is not None and _spec.loader is not None and _os.path.isfile(_spec.origin or ""):
        _m = _u.module_from_spec(_spec)
        _sys.modules["sitecustomize"] = _m
        _spec.loader.exec_module(_m)
        break
'''


def write_runtime_dir(dest: Path) -> None:
    """Write the runtime into ``dest`` (an empty directory): files 0644, directories 0755."""
    package = Path(__file__).resolve().parent
    (dest / "tpagent_rank").mkdir(mode=0o755)
    for f in sorted(package.glob("*.py")):
        shutil.copyfile(f, dest / "tpagent_rank" / f.name)
        os.chmod(dest / "tpagent_rank" / f.name, 0o644)
    (dest / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.chmod(dest / "sitecustomize.py", 0o644)
    os.chmod(dest / "tpagent_rank", 0o755)
