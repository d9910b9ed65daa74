"""tpagent_rank: the part of tpagent that runs inside a user's training process (one per rank).

Contract (checked by scripts/check_layers.py and tests/unit/test_rank_isolation.py):

* It is loaded from a directory that holds only this package and its ``.pth`` file, put on
  the training process's ``PYTHONPATH`` (the ``.pth`` makes the interpreter import it at
  start-up).  So whatever this package imports lands in the user's environment.
* Hence it imports only the standard library, and ``torch`` only lazily (inside the function
  that needs it) and only the user's own, from their environment; never ``tpagent``,
  ``snapshot``, ``transfer`` or ``cli`` (whose generic top-level names would shadow or clash
  with the user's modules), nor any of their dependencies (grpc, psutil, zstandard...).
* Its name is unique (``tpagent_rank``), so it cannot collide with a user's package.

``__version__`` is the tpagent release it belongs to (kept equal to pyproject.toml's
``version`` by a unit test: a user's process has no distribution metadata of ours to read).
"""

from __future__ import annotations

from tpagent_rank.aware import register
from tpagent_rank.join import joining

__all__ = ["joining", "register"]
__version__ = "0.1.0"
