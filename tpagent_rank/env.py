"""What the runtime reads of its process's environment once, at start-up (:mod:`tpagent_rank.boot`).

``TPAGENT_RANK_JOIN`` is taken out as it is read: a process the joiner starts (a DataLoader
worker, a subprocess) is not a joiner."""

from __future__ import annotations

import os

from tpagent_rank import protocol as P

#: This process is a joiner (:mod:`tpagent_rank.join`): a fresh process of a rank's command.
JOIN = os.environ.pop(P.JOIN_VARIABLE, "") == "1"
