"""What the runtime reads of its process's environment once, at start-up (:mod:`tpagent_rank.boot`).

``TPAGENT_RANK_JOIN`` and ``TPAGENT_RANK_STATE`` are taken out as they are read: a process the
joiner starts (a DataLoader worker, a subprocess) is not a joiner.  What the process started with
(its environment, less those, and its working directory) is kept: a rank that restarts in its own
process (:mod:`tpagent_rank.recover`) runs its command again as it was started."""

from __future__ import annotations

import contextlib
import os

from tpagent_rank import protocol as P

#: This process is a joiner (:mod:`tpagent_rank.join`): a fresh process of a rank's command.
JOIN = os.environ.pop(P.JOIN_VARIABLE, "") == "1"
#: A joiner that is a rank restarted in its own process: the state it held, as
#: :func:`tpagent_rank.recover.restart` left it ("": none).
STATE = os.environ.pop(P.STATE_VARIABLE, "")
#: The environment and working directory the process started with.
START_ENV = dict(os.environ)
START_CWD = ""
with contextlib.suppress(OSError):
    START_CWD = os.getcwd()
