"""Test workload: memory, threads, an open file and a pipe, each checkable after a restore.

    python stateful.py LOG MIB [--device PATH] [--map FILE]

Writes to LOG (opened once, kept open):
    digest HEX                   at start: SHA-256 of its MIB MiB of state
    tick N counter C piped P     every 20 ms: N counts up by one, C is a thread's counter,
                                 P the last value another thread read from an internal pipe
    verify HEX                   on SIGUSR1: the state's SHA-256 computed afresh
--device PATH also holds PATH open (a character device CRIU cannot dump, such as /dev/fuse: a
real dump failure, found only once the tree is frozen).
--map FILE keeps FILE mapped (tests name it like the CUDA driver library).
--ghost FILE MIB writes MIB MiB of random bytes to FILE, keeps it open and deletes it (a
deleted-but-open file, as DataLoader workers' shared memory is); ``ghost HEX`` at start and on
SIGUSR1 is the SHA-256 of what the open file holds.
--scratch FILE MIB writes MIB MiB of random bytes to FILE and keeps it open (a node-local
scratch file); ``scratch HEX`` at start and on SIGUSR1 is the SHA-256 of what it holds.
--shm FILE maps FILE (1 MiB, created with random bytes if missing) shared and closes its fd, as
shm_open + mmap + close does: only /proc/PID/maps shows it.  Every tick writes the tick number
into its first 8 bytes; ``shm N HEX`` on SIGUSR1: that number and the SHA-256 of the rest.
--listen DIR makes a private directory in DIR and listens there on a unix socket, as each
DataLoader worker's multiprocessing does (DIR/pymp-XXXX/listener-XXXX: it hands batches' shared
memory over it); ``listen PATH`` at start; on SIGUSR1 it connects to it and ``listened PATH N``
is what came back: N counts the connections it has accepted.
--lock FILE holds an exclusive flock on FILE (opened to append) for its whole life; --lockf FILE
an exclusive fcntl (POSIX) lock on its first 100 bytes.
--needs FILE exits (status 3) at the first tick FILE is missing, writing no tick: a process
that needs something of its node (a copy restored on a node without it dies at once).
"""

import ctypes
import fcntl
import hashlib
import mmap
import os
import signal
import socket
import struct
import sys
import tempfile
import threading
import time

log_path = sys.argv[1]
mib = int(sys.argv[2])
if "--lock" in sys.argv:
    locked = open(sys.argv[sys.argv.index("--lock") + 1], "a")  # noqa: SIM115 (held for its whole life)
    fcntl.flock(locked, fcntl.LOCK_EX)
if "--lockf" in sys.argv:
    lockf = open(sys.argv[sys.argv.index("--lockf") + 1], "a")  # noqa: SIM115 (held for its whole life)
    fcntl.lockf(lockf, fcntl.LOCK_EX, 100, 0)

if "--device" in sys.argv:
    device = os.open(sys.argv[sys.argv.index("--device") + 1], os.O_RDWR)

if "--map" in sys.argv:
    with open(sys.argv[sys.argv.index("--map") + 1], "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)

ghost = None
if "--ghost" in sys.argv:
    at = sys.argv.index("--ghost")
    # (open for the workload's whole life: a deleted file still open is what CRIU must carry)
    ghost = open(sys.argv[at + 1], "w+b")  # noqa: SIM115
    ghost.write(os.urandom(int(sys.argv[at + 2]) << 20))
    ghost.flush()
    os.unlink(sys.argv[at + 1])


scratch = None
if "--scratch" in sys.argv:
    at = sys.argv.index("--scratch")
    # (open for the workload's whole life: a node-local file a migration must take along)
    scratch = open(sys.argv[at + 1], "w+b")  # noqa: SIM115
    scratch.write(os.urandom(int(sys.argv[at + 2]) << 20))
    scratch.flush()

shm = None
if "--shm" in sys.argv:
    shm_path = sys.argv[sys.argv.index("--shm") + 1]
    if not os.path.exists(shm_path):
        with open(shm_path, "wb") as f:
            f.write(bytes(8) + os.urandom((1 << 20) - 8))
    fd = os.open(shm_path, os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 4
    addr = libc.mmap(None, 1 << 20, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    os.close(fd)  # only the mapping is left (Python's own mmap would keep a dup of the fd)
    shm = (ctypes.c_char * (1 << 20)).from_address(addr)

listener = None
if "--listen" in sys.argv:
    where = tempfile.mkdtemp(prefix="pymp-", dir=sys.argv[sys.argv.index("--listen") + 1])  # (mode 700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(where, "listener-" + os.urandom(4).hex()))
    listener.listen()


def serve() -> None:
    assert listener is not None
    accepted = 0
    while True:
        conn, _ = listener.accept()
        accepted += 1
        with conn:
            conn.sendall(struct.pack("<Q", accepted))


def ask_listener() -> int:
    assert listener is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(listener.getsockname())
        return int(struct.unpack("<Q", s.recv(8))[0])


def file_digest(f) -> str:  # type: ignore[no-untyped-def]
    return hashlib.sha256(os.pread(f.fileno(), os.fstat(f.fileno()).st_size, 0)).hexdigest()


def ghost_digest() -> str:
    assert ghost is not None
    return hashlib.sha256(os.pread(ghost.fileno(), os.fstat(ghost.fileno()).st_size, 0)).hexdigest()


block = hashlib.sha256(b"tpagent").digest() * (1 << 15)  # 1 MiB
state = bytearray(block * mib)
for i in range(0, len(state), 4096 * 7):  # make pages differ from each other
    state[i : i + 8] = struct.pack("<Q", i)

counter = 0
piped = 0
read_end, write_end = os.pipe()
verify_requested = threading.Event()


def count() -> None:
    global counter
    while True:
        counter += 1
        os.write(write_end, struct.pack("<Q", counter))
        time.sleep(0.005)


def drain() -> None:
    global piped
    while True:
        piped = struct.unpack("<Q", os.read(read_end, 8))[0]


signal.signal(signal.SIGUSR1, lambda *_: verify_requested.set())
threading.Thread(target=count, daemon=True).start()
threading.Thread(target=drain, daemon=True).start()
if listener is not None:
    threading.Thread(target=serve, daemon=True).start()
with open(log_path, "a", buffering=1) as log:
    log.write(f"digest {hashlib.sha256(state).hexdigest()}\n")
    if ghost is not None:
        log.write(f"ghost {ghost_digest()}\n")
    if scratch is not None:
        log.write(f"scratch {file_digest(scratch)}\n")
    if shm is not None:
        log.write(f"shm {struct.unpack_from('<Q', shm)[0]} {hashlib.sha256(shm[8:]).hexdigest()}\n")
    if listener is not None:
        log.write(f"listen {listener.getsockname()}\n")
    tick = 0
    needs = sys.argv[sys.argv.index("--needs") + 1] if "--needs" in sys.argv else None
    while True:
        if needs is not None and not os.path.exists(needs):
            os._exit(3)
        if verify_requested.is_set():
            verify_requested.clear()
            log.write(f"verify {hashlib.sha256(state).hexdigest()}\n")
            if ghost is not None:
                log.write(f"ghost {ghost_digest()}\n")
            if scratch is not None:
                log.write(f"scratch {file_digest(scratch)}\n")
            if shm is not None:
                log.write(f"shm {struct.unpack_from('<Q', shm)[0]} {hashlib.sha256(shm[8:]).hexdigest()}\n")
            if listener is not None:
                log.write(f"listened {listener.getsockname()} {ask_listener()}\n")
        if shm is not None:
            struct.pack_into("<Q", shm, 0, tick)
        log.write(f"tick {tick} counter {counter} piped {piped}\n")
        tick += 1
        time.sleep(0.02)
