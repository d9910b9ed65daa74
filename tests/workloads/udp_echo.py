"""The service tests/workloads/loopback_asker.py asks: echoes every UDP datagram.

python udp_echo.py PORT
"""

import socket
import sys

with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.bind(("127.0.0.1", int(sys.argv[1])))
    while True:
        data, peer = s.recvfrom(64)
        s.sendto(data, peer)
