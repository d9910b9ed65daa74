"""What every benchmark here takes on its command line."""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import Any


def arguments(doc: str, sizes_mib: str, gpu: bool = False) -> argparse.ArgumentParser:
    """--sizes-mib, --repeats, --dir (where images live), --json-out, and --gpu where it applies."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--sizes-mib", default=sizes_mib)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--json-out", type=Path)
    if gpu:
        ap.add_argument("--gpu", action="store_true")
    return ap


def emit(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """The result as one JSON line on stdout (the last line), and in --json-out if given."""
    print(json.dumps(doc))
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2))


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended, so far."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
