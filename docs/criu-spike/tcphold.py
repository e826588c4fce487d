#!/usr/bin/python3
"""tcphold.py HOST PORT SECONDS: connect, wait SECONDS (the sandbox sleeps and wakes meanwhile),
then send and print the answer: an established connection that survived."""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
time.sleep(float(sys.argv[3]))
s.sendall(b"x")
print("after sleep/wake the held connection answers:", s.recv(100))
