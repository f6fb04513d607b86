"""The wire between clients and the daemon: one JSON object per line, both ways.

Small and text-based on purpose: a person can talk to the daemon with
``socat - UNIX-CONNECT:daemon.sock`` while debugging. Who is asking is never
taken from a message: the daemon reads it from the socket (``SO_PEERCRED``,
``SO_PEERPIDFD``).
"""

from __future__ import annotations

import json
import socket
from typing import Any

MAX_MESSAGE = 64 * 1024

Message = dict[str, Any]


class ProtocolError(Exception):
    pass


def encode(msg: Message) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


class LineBuffer:
    """Accumulates bytes from a stream socket and yields complete messages."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > MAX_MESSAGE:
                    raise ProtocolError("message too long")
                return out
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                raise ProtocolError(f"not JSON: {line[:80]!r}") from None
            if not isinstance(msg, dict):
                raise ProtocolError("a message must be a JSON object")
            out.append(msg)


def send(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode(msg))
