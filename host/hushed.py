"""A warning that anyone may repeat at will (a refused connection, a broken handshake): said at
most once a second, each left out counted and its number said with the next.  Root's log is the
node's record: one caller's flood must not fill it, nor hide the other lines in it."""

from __future__ import annotations

import logging
import threading
import time


class Hushed:
    """One kind of such warning, of ``logger``."""

    def __init__(self, logger: logging.Logger, every: float = 1.0) -> None:
        self.logger = logger
        self.every = every
        self.lock = threading.Lock()
        self.last = -every
        self.left_out = 0

    def warning(self, msg: str, *args: object) -> None:
        """``logger.warning(msg, *args)``, unless one was said less than ``every`` seconds ago."""
        with self.lock:
            now = time.monotonic()
            if now - self.last < self.every:
                self.left_out += 1
                return
            left = self.left_out
            self.left_out = 0
            self.last = now
        self.logger.warning(msg + "%s", *args, f" (and {left} more like it not logged)" if left else "")
