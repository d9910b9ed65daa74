"""This node's wall clock, as the agents compare it with each other.

Only the signatures of calls depend on two nodes' clocks agreeing (:mod:`tpagent.daemon.rpc`: a
call's timestamp must lie within :data:`WINDOW` of the receiving agent's clock).  The rules:

* A migration starts only between nodes whose clocks are within :data:`START_LIMIT` of each
  other (measured at check time; ``tpagent node`` shows an agent's offset too).
* A step of either clock afterwards does not stop a migration half-way: an agent that refuses
  a call for its timestamp says what its clock reads, and the caller signs its calls to that
  agent on that agent's clock from then on (:class:`tpagent.daemon.rpc` ``_ClientAuth``).  Replays
  stay refused: the window and the nonces are the receiving agent's, on its own clock.

``TPAGENT_TEST_CLOCK_OFFSET_FILE`` is a hook for the test suite only (CLOCK_REALTIME cannot be
namespaced): if set, the number of seconds in that file (read at each use) is added to this
agent's clock, as a stepped clock would be.  It changes nothing else, and nothing that a
root user who can set an agent's environment could not do by setting the system clock; a
file anyone but root could write is ignored, as is anything but a finite number.
"""

from __future__ import annotations

import math
import os
import stat
import time

#: A signed call's timestamp may be this far from the receiving agent's clock (seconds).
WINDOW = 60.0
#: A migration starts only between nodes whose clocks are at most this far apart (seconds).
START_LIMIT = WINDOW / 2
_TEST_OFFSET_FILE = "TPAGENT_TEST_CLOCK_OFFSET_FILE"


def now() -> float:
    """Unix seconds, as this agent's signatures and checks read them."""
    path = os.environ.get(_TEST_OFFSET_FILE)
    if not path:
        return time.time()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return time.time()
            offset = float(f.read(64).strip() or 0)
    except (OSError, ValueError):
        return time.time()
    return time.time() + offset if math.isfinite(offset) else time.time()


def apart(offset: float) -> str:
    """How a message says that another clock is ``offset`` seconds off this one."""
    return f"{abs(offset):.1f} s {'ahead of' if offset > 0 else 'behind'}"
