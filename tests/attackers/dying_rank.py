"""A "rank" another user starts through the agent's stand-in channel (``tpagent rank``): it says
hello to its agent as rank RANK of the job named TPAGENT_JOB (another user's job, running on
other nodes), then dies by SIGKILL, so that its agent holds its end and reports it as died; with
``stay``, it stays instead, saying nothing more, until it is killed.

    python dying_rank.py [stay]          (its environment as its stand-in gives it)
"""

import os
import signal
import socket
import sys
import time

from tpagent_rank import codec, lines

name = os.environ.get("TPAGENT_RANK_SOCKET", "tpagent-ranks")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + name)
s.sendall(codec.said(lines.Hello(os.environ["TPAGENT_JOB"], int(os.environ["RANK"]), 3, pid=os.getpid())))
print("its agent said:", s.makefile("rb").readline().decode().strip(), flush=True)
time.sleep(3600 if sys.argv[1:] == ["stay"] else 1)
os.kill(os.getpid(), signal.SIGKILL)
