"""A TCP proxy to a Unix socket:
``python -m toolledger.harness.chaos.proxy --listen HOST:PORT --unix PATH``.

Run inside a network namespace (``toolledger.harness.chaos.partition``), it is a worker's only
way to Postgres: cutting the namespace's link then black-holes that worker's connections — packets
vanish, no RST — while Postgres itself and everyone else are untouched. One thread per
direction per connection; it prints ``proxy ready HOST:PORT`` once it listens (``--listen
HOST:0``: a free port). Stopped (SIGSTOP), it is a frozen server to its clients: its kernel
still accepts and acknowledges, nothing answers.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def _serve(client: socket.socket, unix_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(unix_path)
    except OSError:
        client.close()
        return
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--unix", required=True, help="the Unix socket to forward to")
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, int(port)))
    server.listen(128)
    print(f"proxy ready {host}:{server.getsockname()[1]}", flush=True)  # PORT 0: one free
    while True:
        client, _ = server.accept()
        _serve(client, args.unix)


if __name__ == "__main__":
    main()
