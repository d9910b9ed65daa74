"""What a rank's runtime says on its own: one line on standard error, marked as ours."""

from __future__ import annotations

import sys

#: What the rank says when it cannot keep a rule of the protocol (stderr, one line).
PREFIX = "tpagent_rank: "


def say(text: str) -> None:
    print(PREFIX + text, file=sys.stderr, flush=True)
