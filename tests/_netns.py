"""Two network namespaces joined by a veth pair ("two hosts" on one machine), and Python
children run inside them with ``ip netns exec``, whose output lines the tests wait on.

Only root can make namespaces; the veth pair is created directly inside them, so it never
exists in the test's own namespace, and deleting the namespaces deletes it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent  # the checkout: children import its aioshmq
IP_TIMEOUT = 10.0


class Unavailable(Exception):
    """Namespaces cannot be made here (not root, no ``ip``, no kernel support)."""


def ip(*args: str, ns: str | None = None) -> str:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _in_ns(ns: str, *cmd: str) -> str:
    return ip("netns", "exec", ns, *cmd)


class Pair:
    """Namespaces ``a`` and ``b``, with ``a_ip`` and ``b_ip`` on the two ends of a veth."""

    def __init__(self, tag: str, subnet: int) -> None:
        self.a, self.b = f"aioshmq-{tag}-a", f"aioshmq-{tag}-b"
        self.a_dev, self.b_dev = f"shm{tag}a"[:15], f"shm{tag}b"[:15]
        self.a_ip, self.b_ip = f"10.199.{subnet}.1", f"10.199.{subnet}.2"
        self._made: list[str] = []

    def create(self) -> None:
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise Unavailable("no `ip` command (iproute2)")
        for ns in (self.a, self.b):
            try:
                ip("netns", "add", ns)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                self.delete()
                raise Unavailable(f"`ip netns add` failed: {exc}") from None
            self._made.append(ns)
        try:
            try:
                ip(
                    "link", "add", self.a_dev, "netns", self.a, "type", "veth",
                    "peer", "name", self.b_dev, "netns", self.b,
                )  # fmt: skip
            except RuntimeError as exc:
                raise Unavailable(f"no veth pair: {exc}") from None
            for ns, dev, addr in ((self.a, self.a_dev, self.a_ip), (self.b, self.b_dev, self.b_ip)):
                ip("addr", "add", f"{addr}/24", "dev", dev, ns=ns)
                ip("link", "set", dev, "up", ns=ns)
                ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.delete()
            raise

    def set_link(self, up: bool) -> None:
        """Take the veth down (its A end: B's end loses its carrier too) or up again."""
        ip("link", "set", self.a_dev, "up" if up else "down", ns=self.a)
        if up:
            ip("link", "set", self.b_dev, "up", ns=self.b)

    def connections(self, side: str) -> dict[str, tuple[int, int]]:
        """Established TCP connections from namespace ``side`` ("a" or "b") to the other:
        this side's 'address:port' -> (bytes received and not yet read, bytes sent and not
        yet acknowledged)."""
        ns, peer = (self.a, self.b_ip) if side == "a" else (self.b, self.a_ip)
        out = _in_ns(ns, "ss", "-H", "-t", "-n", "state", "established", "dst", peer)
        found = {}
        for line in out.splitlines():
            recv_q, send_q, local = line.split()[:3]
            found[local] = (int(recv_q), int(send_q))
        return found

    def reset(self, side: str) -> bool:
        """Destroy namespace ``side``'s TCP connections to the other (``ss -K``): its
        sockets see an error at once.  False if the kernel cannot do that."""
        ns, peer = (self.a, self.b_ip) if side == "a" else (self.b, self.a_ip)
        before = self.connections(side)
        _in_ns(ns, "ss", "-K", "-t", "-n", "dst", peer)
        return not before.keys() & self.connections(side).keys()

    def b_received(self) -> int:
        """Bytes B's end of the veth has received so far."""
        (link,) = json.loads(ip("-j", "-s", "link", "show", "dev", self.b_dev, ns=self.b))
        return int(link["stats64"]["rx"]["bytes"])

    def delete(self) -> None:
        """Delete the namespaces (and with them the veth); what cannot be deleted is named."""
        errors = []
        for ns in reversed(self._made):
            try:
                ip("netns", "del", ns)
            except Exception as exc:
                errors.append(str(exc))
        self._made.clear()
        if errors:
            raise RuntimeError("; ".join(errors))


class Child:
    """A Python child in a namespace, in a session of its own; its stdout lines are read
    by a thread, so a test waits for a line with a deadline instead of sleeping."""

    def __init__(self, label: str, ns: str, script: str, args: list[str], env: dict[str, str]):
        self.label = label
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", script, *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream: IO[str], is_out: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            (self.out if is_out else self.err).append(line)
            if is_out:
                self.lines.put(line)
        if is_out:
            self.lines.put(None)  # end of output: the child exited (or closed stdout)

    def send(self, line: str) -> None:
        """A line to its stdin (which a script may wait on)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout: float) -> list[str]:
        """Wait for the next output line whose first word is ``word``; its other words.
        AssertionError (with the child's output) if it exits first or takes too long."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0))
            except queue.Empty:
                raise AssertionError(
                    f"{self.label}: no {word!r} line within {timeout} s\n{self.report()}"
                ) from None
            if line is None:
                self.lines.put(None)
                self.wait(5)
                raise AssertionError(
                    f"{self.label} ended (exit {self.proc.returncode}) before a {word!r} "
                    f"line\n{self.report()}"
                )
            words = line.split()
            if words and words[0] == word:
                return words[1:]

    def wait(self, timeout: float) -> int:
        """Its exit status; AssertionError (after killing it) if it runs over ``timeout``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.label} still running after {timeout} s\n{self.report()}"
            ) from None
        for t in self._threads:
            t.join(5)
        return code

    def ok(self, timeout: float) -> None:
        """Wait for it to exit, and require exit status 0."""
        code = self.wait(timeout)
        assert code == 0, f"{self.label} exited with {code}\n{self.report()}"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for t in self._threads:
            t.join(5)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # stdin: a pipe whose reader is gone
                    pass

    def report(self) -> str:
        return (
            f"--- {self.label} stdout:\n" + "\n".join(self.out[-40:])
            + f"\n--- {self.label} stderr:\n" + "\n".join(self.err[-60:])
        )  # fmt: skip


class Children:
    """Every child a test starts; all killed (with their sessions) at the end."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.started: list[Child] = []

    def start(self, label: str, ns: str, script: str, *args: object) -> Child:
        child = Child(label, ns, script, [str(a) for a in args], self.env)
        self.started.append(child)
        return child

    def kill_all(self) -> None:
        for child in self.started:
            child.kill()

    def report(self) -> str:
        return "\n".join(child.report() for child in self.started)
