"""Test workload: a loop that holds an io_uring instance (as an async I/O library would).

    python io_uring_loop.py LOG

Writes ``tick N`` to LOG every 20 ms; exits with status 3 if the kernel gives no io_uring.
"""

import ctypes
import os
import sys
import time

SYS_IO_URING_SETUP = 425  # (x86_64 and arm64 alike)
libc = ctypes.CDLL(None, use_errno=True)


def main() -> None:
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    ring = libc.syscall(SYS_IO_URING_SETUP, 8, params)
    if ring < 0:
        print(f"no io_uring: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        sys.exit(3)
    with open(sys.argv[1], "a", buffering=1) as log:
        n = 0
        while True:
            log.write(f"tick {n}\n")
            n += 1
            time.sleep(0.02)


if __name__ == "__main__":
    main()
