"""A user's rank that says what no rank should (standard library only, run as its user inside a
launched namespace): a hello, then, by MODE, a line that breaks the rules.

    python rank_lines.py SOCKET JOB RANK MODE

    surrogate  a hello whose job key is a lone surrogate (JSON "\\udc80")
    broke      a good hello, then "broke" whose reason is a lone surrogate
    brokes     a good hello, then "broke" 500 times
    deep       a good hello, then a line of arrays 20 000 deep (well within a line's bytes)
    mute       a good hello, then it reads nothing more (the agent's writes to it fill its buffer)

It prints the agent's first line and stays connected for 60 s."""

import socket
import sys
import time

name, job, rank, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + name)
key = '"\\udc80"' if mode == "surrogate" else '"k"'
s.sendall(f'{{"op":"hello","job":"{job}","rank":{rank},"world":2,"key":{key}}}\n'.encode())
print(s.makefile("rb").readline().decode(errors="replace").strip() or "(closed)", flush=True)
if mode == "broke":
    s.sendall(b'{"op":"broke","why":"\\udc80"}\n')
elif mode == "brokes":
    s.sendall(b'{"op":"broke","why":"x"}\n' * 500)
elif mode == "deep":
    s.sendall(b'{"op":"stepped","step":' + b"[" * 20000 + b"\n")
time.sleep(60)
