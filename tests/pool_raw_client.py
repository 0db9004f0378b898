"""A process that speaks the pool's wire protocol itself, for tests that kill it between the steps of a
store: ``python tests/pool_raw_client.py PATH PREFIX N`` attaches to the pool at PATH and prints
``{"event": "attached"}``; then, a command a line on stdin: ``begin`` sends a BEGIN of the keys
``PREFIX-0`` to ``PREFIX-(N-1)`` and prints ``sent``, ``wait`` reads until its answer and prints
``begun`` with the claim, ``commit`` sends the COMMIT and prints ``committing`` (without waiting for the
answer). It writes no byte into the slots: what is tested is the owner's books."""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np

from aiokvtier._pool import _wire


def out(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def read_frame(sock: socket.socket) -> _wire.Message:
    head = b""
    while len(head) < _wire.LENGTH.size:
        data, fds, _, _ = socket.recv_fds(sock, _wire.LENGTH.size - len(head), 4)
        for fd in fds:
            os.close(fd)
        if not data:
            raise ConnectionError("the owner closed the connection")
        head += data
    (size,) = _wire.LENGTH.unpack(head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the owner closed the connection")
        body += chunk
    return _wire.decode(body)


def main(path: str, prefix: str, n: int) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(_wire.encode(_wire.HELLO, 0, {"v": _wire.VERSION, "pid": os.getpid()}))
    while read_frame(sock).op != _wire.WELCOME:
        pass
    out("attached", pid=os.getpid())
    keys = [b"%s-%d" % (prefix.encode(), i) for i in range(n)]
    kind, parts = _wire.encode_keys(keys)
    claim = 0
    for line in sys.stdin:
        command = line.strip()
        if command == "begin":
            sock.sendall(_wire.encode(_wire.BEGIN, 1, {"k": kind}, [*parts, np.full(n, 64, np.uint64).tobytes()]))
            out("sent")
        elif command == "wait":
            while (message := read_frame(sock)).rid != 1:
                pass
            claim = int(message.fields.get("claim", 0))
            out("begun", claim=claim, op=message.op)
        elif command == "commit":
            sock.sendall(_wire.encode(_wire.COMMIT, 2, {"claim": claim}))
            out("committing")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
