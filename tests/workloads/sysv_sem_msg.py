"""Test workload: a count kept in a SysV message queue, and a SysV semaphore counting with it.

    python sysv_sem_msg.py LOG

It makes a message queue and a semaphore (IPC_PRIVATE) and writes ``ids SEMID MSQID`` to LOG.
Then every 20 ms it takes the one message from the queue (the count N), adds one to the
semaphore, writes ``tick N sem V`` (V: the semaphore's value, which equals N + 1) and puts N + 1
back.  Its count lives in the kernel's objects alone: a restore that did not bring them back
leaves it waiting on a queue that names nothing (an error), or one that is empty.
"""

import ctypes
import struct
import sys
import time

IPC_PRIVATE = 0
IPC_CREAT = 0o1000
GETVAL = 12
libc = ctypes.CDLL(None, use_errno=True)


class Sembuf(ctypes.Structure):
    _fields_ = [("num", ctypes.c_ushort), ("op", ctypes.c_short), ("flg", ctypes.c_short)]


def checked(result: int, what: str) -> int:
    if result < 0:
        raise OSError(ctypes.get_errno(), what)
    return result


def main() -> None:
    sem = checked(libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600), "semget")
    queue = checked(libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600), "msgget")
    message = ctypes.create_string_buffer(16)  # (struct msgbuf: its type, then 8 bytes: the count)
    struct.pack_into("lq", message, 0, 1, 0)
    checked(libc.msgsnd(queue, message, 8, 0), "msgsnd")
    up = Sembuf(0, 1, 0)
    with open(sys.argv[1], "a", buffering=1) as log:
        log.write(f"ids {sem} {queue}\n")
        while True:
            checked(libc.msgrcv(queue, message, 8, 0, 0), "msgrcv")
            n = struct.unpack_from("q", message, 8)[0]
            checked(libc.semop(sem, ctypes.byref(up), 1), "semop")
            log.write(f"tick {n} sem {checked(libc.semctl(sem, 0, GETVAL), 'semctl')}\n")
            struct.pack_into("q", message, 8, n + 1)
            checked(libc.msgsnd(queue, message, 8, 0), "msgsnd")
            time.sleep(0.02)


if __name__ == "__main__":
    main()
