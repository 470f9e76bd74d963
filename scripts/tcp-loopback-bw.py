#!/usr/bin/env python3
"""Loopback TCP bandwidth: one socket, 64 MiB in 1 MiB sends, timed to the receiver's ack.

The baseline the tcp;ofi_rxm fetch is compared against in docs/perf.md ("tcp;ofi_rxm fetch
against loopback TCP"): what the kernel's loopback moves for one plain stream on this machine.
Usage: python3 scripts/tcp-loopback-bw.py [MiB]
"""
import socket
import sys
import threading
import time

MIB = 1 << 20
total = int(sys.argv[1]) * MIB if len(sys.argv) > 1 else 64 * MIB
chunk = b"\0" * MIB

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)


def receive():
    conn, _ = server.accept()
    got, buf = 0, bytearray(MIB)
    while got < total:
        n = conn.recv_into(buf)
        if n == 0:
            raise SystemExit("sender closed early")
        got += n
    conn.sendall(b"k")


rx = threading.Thread(target=receive)
rx.start()
sender = socket.create_connection(server.getsockname())
started = time.perf_counter()
for _ in range(total // MIB):
    sender.sendall(chunk)
sender.recv(1)
elapsed = time.perf_counter() - started
rx.join()
print(f"loopback tcp {total // MIB} MiB: {elapsed * 1e3:.1f} ms, {total / elapsed / 1e9:.2f} GB/s")
