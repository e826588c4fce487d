import socket, threading, time, sys, os
mb = int(sys.argv[2]) if len(sys.argv) > 2 else 0
ballast = bytearray(os.urandom(mb * 1024 * 1024)) if mb else b""
count = 0
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(16)
    while True:
        c, _ = s.accept()
        try:
            c.recv(100); c.sendall(("count=%d pid=%d ballast=%d\n" % (count, os.getpid(), len(ballast))).encode())
        finally:
            c.close()
threading.Thread(target=serve, args=(int(sys.argv[1]),), daemon=True).start()
while True:
    count += 1
    if count % 10 == 0:
        with open("/tmp/count.txt", "w") as f: f.write(str(count))
    time.sleep(0.1)
