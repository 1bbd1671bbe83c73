"""A bound on the connections that have not authenticated yet: strangers cannot hold more."""

from __future__ import annotations

import os
import socket

import zmq
import zmq.utils.monitor

MAX_UNAUTHENTICATED = 32  # connections accepted and not yet through their handshake


class Guard:
    """Watches the connections a listening socket accepts (ZeroMQ's monitor events) until
    each delivers its first message, which only an authenticated peer can do; over
    MAX_UNAUTHENTICATED such connections, the oldest are shut.  ZeroMQ itself closes one
    whose handshake outlasts the socket's handshake timeout: this bounds how many a flood
    of strangers holds open meanwhile (their file descriptors and buffers)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._sock = sock
        self._pending: dict[int, None] = {}  # fd of each, oldest first
        self.shed = 0  #: connections shut for want of room

    @property
    def pending(self) -> int:
        """Connections accepted and not yet heard from."""
        return len(self._pending)

    def watch(self) -> int:
        """Take the monitor's events in; shut the oldest connections over the bound.
        Returns how many connections finished their handshake (a peer is back)."""
        joined = 0
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = zmq.utils.monitor.parse_monitor_message(frames)
            fd = int(event["value"])
            self._pending.pop(fd, None)  # a number closed and given out again starts over
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._pending[fd] = None
            joined += event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        while len(self._pending) > MAX_UNAUTHENTICATED:
            fd = next(iter(self._pending))
            del self._pending[fd]
            _shut(fd)
            self.shed += 1
        return joined

    def heard(self, frame: zmq.Frame) -> None:
        """A message arrived: its connection is through its handshake."""
        if self._pending:
            try:
                self._pending.pop(frame.get(zmq.SRCFD), None)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        self._sock.disable_monitor()
        self.monitor.close(linger=0)


def _shut(fd: int) -> None:
    """Shut the connection on ``fd`` (ZeroMQ's, which then closes it and says so)."""
    try:
        dup = os.dup(fd)
    except OSError:  # closed meanwhile
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # given out again, and not to a socket
        os.close(dup)
        return
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
