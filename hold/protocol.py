"""The wire between clients and the daemon: one JSON object per line, both ways.

Small and text-based on purpose: a person can talk to the daemon with
``socat - UNIX-CONNECT:daemon.sock`` while debugging. Who is asking is never
taken from a message: the daemon reads it from the socket (``SO_PEERCRED``,
``SO_PEERPIDFD``).

Decoded strictly (:mod:`supervisor.jsonlines`): a message is at most
:data:`MAX_MESSAGE` bytes and :data:`MAX_DEPTH` deep, UTF-8 with no lone
surrogate, no duplicate key and no ``NaN``; anything else is a
:class:`ProtocolError`, which ends that connection and nothing else.
"""

from __future__ import annotations

import socket
from typing import Any

from supervisor import jsonlines

MAX_MESSAGE = jsonlines.MAX_LINE
MAX_DEPTH = jsonlines.MAX_DEPTH

Message = dict[str, Any]


class ProtocolError(Exception):
    pass


def encode(msg: Message) -> bytes:
    return jsonlines.dumps_line(msg)


class LineBuffer:
    """Accumulates bytes from a stream socket and yields complete messages."""

    __slots__ = ("_lines",)

    def __init__(self) -> None:
        self._lines = jsonlines.LineBuffer(MAX_MESSAGE, MAX_DEPTH)

    def feed(self, data: bytes) -> list[Message]:
        """The messages ``data`` completes; :class:`ProtocolError` at the first bad one."""
        try:
            return self._lines.feed(data)
        except jsonlines.BadJSON as e:
            raise ProtocolError(str(e)) from None


def send(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode(msg))
