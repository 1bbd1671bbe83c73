# ruff: noqa: E501 - one mutation a line reads best
"""Mutation checks: remove a guaranteed behaviour, run the test meant to catch it, expect
a failure.  Each row: name, file, the code removed, what replaces it, the test.

    python tools/mutations.py [NAME-FRAGMENT ...]
"""

import os
import shutil
import subprocess
import sys
import tempfile

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(tempfile.gettempdir(), "aioshmq-mutations")
HANG = 120  # seconds after which a test run counts as hung
M = [
    (
        "dead reader -> PeerDied",
        "aioshmq/_broker.py",
        "        if conn.bye or self.detach_dead:",
        "        if True:",
        "tests/test_broker.py::test_dead_reader_fails_a_waiting_put",
    ),
    (
        "detach mode",
        "aioshmq/_broker.py",
        "        if conn.bye or self.detach_dead:",
        "        if conn.bye:",
        "tests/test_broker.py::test_dead_reader_detached",
    ),
    (
        "pidfd watch",
        "aioshmq/_broker.py",
        "        conn.pidfd = pidfd_of(conn.pid)",
        "        conn.pidfd = -1",
        "tests/test_broker.py::test_dead_reader_fails_a_waiting_put",
    ),
    (
        "dead writer",
        "aioshmq/_reader.py",
        "                if not ring.available():\n                    self._writer_gone()\n        finally:\n            self._unhold(token)\n\n    def _wait_sync",
        "                pass\n        finally:\n            self._unhold(token)\n\n    def _wait_sync",
        "tests/test_broker.py::test_dead_writer",
    ),
    (
        "no lost wake-up (reader re-check)",
        "aioshmq/_ring.py",
        "        if self.available() or w[self.w_closed]:\n            w[self.r_sleep] = 0\n            return False\n        return True",
        "        return True",
        "tests/test_notify.py::test_no_wake_up_is_lost",
    ),
    (
        "corruption bounds",
        "aioshmq/_ring.py",
        "            if end > cap or self.tail + end - off > self.head:\n                raise CorruptedError(\n                    f\"record at position {self.tail} (kind {kind}) claims {length} bytes, \"\n                    f\"past the {'end of the ring' if end > cap else 'head ' + str(self.head)}\"\n                )\n            base = kind & L.KIND_MASK\n            if base == L.MSG:",
        "            if False:\n                pass\n            base = kind & L.KIND_MASK\n            if base == L.MSG:",
        "tests/test_ring.py::test_scribbled_record",
    ),
    (
        "cancellation rollback",
        "aioshmq/_writer.py",
        "            if atomic:\n                ring.rollback(*start)",
        "            if False:\n                ring.rollback(*start)",
        "tests/test_writer.py::test_cancelled_multi_record_batch_publishes_nothing",
    ),
    (
        "model: reader count",
        "aioshmq/_ring.py",
        "        if size:\n            self.tail += size\n            self.count += self.messages",
        "        if size:\n            self.tail += size",
        "tests/test_model.py::test_model[asyncio]",
    ),
    (
        "leak: wake-up fds",
        "aioshmq/_reader.py",
        "        for fd in {*self._wake.fds(), *self._writer_wake.fds()}:\n            os.close(fd)",
        "        pass",
        "tests/test_end.py::test_no_leaks_over_1000_cycles",
    ),
    (
        "ResourceWarning",
        "aioshmq/_end.py",
        '            _warn(f"unclosed {self!r}", ResourceWarning, source=self)',
        "            pass",
        "tests/test_end.py::test_garbage_collected_ends_warn_and_release",
    ),
    (
        "bad input: capacity",
        "aioshmq/_writer.py",
        '    capacity = _positive_int("capacity", capacity, L.MIN_CAPACITY)',
        "    pass",
        "tests/test_writer.py::test_bad_arguments",
    ),
    (
        "interrupt: sleep flag",
        "aioshmq/_reader.py",
        "                finally:\n                    ring.end_sleep()\n                self._check()",
        "                finally:\n                    pass\n                self._check()",
        "tests/test_end.py::test_keyboard_interrupt_in_get_sync",
    ),
    (
        "SIGKILL leaves nothing (memfd -> /dev/shm)",
        "aioshmq/_segment.py",
        '        fd = os.memfd_create(f"aioshmq:{name}", os.MFD_CLOEXEC)',
        '        fd = os.open(f"/dev/shm/aioshmq-{name}", os.O_RDWR | os.O_CREAT, 0o600)',
        "tests/test_segment.py::test_nothing_survives_sigkill_of_every_process",
    ),
    (
        "asyncio wait fd: no spin when nobody waits",
        "aioshmq/_end.py",
        "            self._unregister()\n            return\n        self._wake.drain()",
        "            return\n        self._wake.drain()",
        "tests/test_end.py::test_wake_ups_nobody_waits_for_neither_spin_the_loop_nor_get_lost",
    ),
    (
        "rpc: one batch per loop turn",
        "aioshmq/rpc.py",
        "                await self._calls.put_many([call._message for call in calls])",
        "                for call in calls:\n                    await self._calls.put(call._message)",
        "tests/test_rpc.py::test_a_batch_is_one_publish_and_one_wake_up",
    ),
    (
        "rpc: a cancelled call is withdrawn",
        "aioshmq/rpc.py",
        "        except BaseException:\n            self.cancel()\n            raise",
        "        except BaseException:\n            raise",
        "tests/test_rpc.py::test_cancelled_call_is_withdrawn_and_its_late_reply_dropped",
    ),
    (
        "rpc: a dead worker fails the calls",
        "aioshmq/rpc.py",
        '            except PeerDied as exc:\n                self._fail(_worker_died(rank, exc.pid, ""))',
        "            except PeerDied as exc:\n                await anyio.sleep_forever()",
        "tests/test_rpc.py::test_dead_worker_fails_pending_and_later_calls",
    ),
    (
        "rpc: a dead scheduler stops the workers",
        "aioshmq/rpc.py",
        "            except (anyio.EndOfStream, PeerDied):\n                return\n            steps",
        "            except anyio.EndOfStream:\n                return\n            except PeerDied:\n                await anyio.sleep_forever()\n            steps",
        "tests/test_rpc.py::test_dead_scheduler_stops_the_workers",
    ),
    (
        "reader checks the writer's uid",
        "aioshmq/_broker.py",
        "        if uid != me and uid not in trusted_uids:",
        "        if False:",
        "tests/test_broker.py::test_reader_refuses_a_ring_served_by_another_user",
    ),
    (
        "broker refuses a malformed request",
        "aioshmq/_broker.py",
        '    except Exception:  # not JSON (nested too deep, say), not an object, no "reader"',
        "    except ValueError:",
        "tests/test_broker.py::test_broker_survives_any_request",
    ),
    (
        "failed connect leaves the slot as it was",
        "aioshmq/_broker.py",
        "        self.ring.restore(index, state)",
        "        self.ring.detach(index)",
        "tests/test_broker.py::test_connect_that_fails_after_the_slot_changed_hands_gives_it_back",
    ),
    (
        "failed connect: the slot is not left attached",
        "aioshmq/_broker.py",
        "        self.ring.restore(index, state)",
        "        pass",
        "tests/test_broker.py::test_connect_that_fails_after_the_slot_changed_hands_gives_it_back",
    ),
    (
        "remote: acknowledged is the ring's tail (nothing lost in flight)",
        "aioshmq/remote/_server.py",
        "            ring.release_to(pos, count)",
        "            ring.release_to(ring.tail, ring.count)",
        "tests/test_remote_server.py::test_the_writer_reuses_only_what_a_remote_reader_acknowledged",
    ),
    (
        "remote: duplicates after a reconnection are dropped",
        "aioshmq/remote/_link.py",
        "    if end_pos <= expect[0]:\n        return None",
        "    if False:\n        return None",
        "tests/test_remote_wire.py::test_what_arrives_twice_is_dropped_by_position",
    ),
    (
        "remote: the ZAP check refuses a key without the secret",
        "aioshmq/remote/_auth.py",
        '        ok = mechanism == b"CURVE" and credentials == [z85.decode(keys.client_public)]',
        '        ok = mechanism == b"CURVE"',
        "tests/test_remote_link.py::test_wrong_or_missing_secret_is_refused_and_the_writer_serves_on",
    ),
    (
        "remote: a silent reader is a dead reader",
        "aioshmq/remote/_server.py",
        "                if now - remote.heard > remote.heartbeat:",
        "                if False:",
        "tests/test_remote_server.py::test_a_killed_remote_reader_is_a_dead_reader",
    ),
    (
        "remote: data messages are checked",
        "aioshmq/remote/_wire.py",
        "        if off + n > size:",
        "        if False:",
        "tests/test_remote_wire.py::test_a_scribbled_run_is_refused",
    ),
    (
        "drop_reader never drops a live reader",
        "aioshmq/_ring.py",
        "            if self.gate.states[index] == ATTACHED:\n                raise busy(",
        "            if False:\n                raise busy(",
        "tests/test_broker.py::test_drop_reader",
    ),
    (
        "blocking calls refused in an event loop",
        "aioshmq/_end.py",
        "        if in_event_loop():\n            raise RuntimeError(",
        "        if False:\n            raise RuntimeError(",
        "tests/test_end.py::test_blocking_calls_are_refused_in_a_running_loop",
    ),
    (
        "get raises a pending cancellation first",
        "aioshmq/_reader.py",
        "        elif (cancelled := pending_checkpoint()) is not None:\n            await cancelled()",
        "        elif False:\n            await cancelled()",
        "tests/test_cancel.py::test_every_await_raises_a_pending_cancellation",
    ),
    (
        "no select() on fds above 1023",
        "aioshmq/_reader.py",
        "    poller = select.poll()\n    poller.register(fd, select.POLLIN)\n    return bool(poller.poll(int(timeout * 1000)))",
        "    return bool(select.select([fd], [], [], timeout)[0])",
        "tests/test_reader.py::test_fd_numbers_above_1023",
    ),
]
only = sys.argv[1:]
failures = 0
for name, path, old, new, test in M:
    if only and not any(o in name for o in only):
        continue
    shutil.rmtree(WORK, ignore_errors=True)
    shutil.copytree(
        SRC, WORK, ignore=shutil.ignore_patterns(".git", "*.egg-info", "__pycache__", ".hypothesis")
    )
    p = os.path.join(WORK, path)
    with open(p) as f:
        s = f.read()
    if s.count(old) != 1:
        print(f"{name}: PATTERN NOT FOUND ({s.count(old)})", flush=True)
        failures += 1
        continue
    with open(p, "w") as f:
        f.write(s.replace(old, new))
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                "--timeout",
                "60",
                test,
            ],
            cwd=WORK,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": WORK},
            # A mutation may turn a wait into a busy loop that pytest-timeout's signal cannot
            # break (the event loop swallows the exception): a hang counts as caught.
            timeout=HANG,
        )
    except subprocess.TimeoutExpired as exc:
        r = subprocess.CompletedProcess(exc.cmd, 1, f"hung for {HANG} s", "")
    for leftover in os.listdir("/dev/shm"):  # what the /dev/shm mutation leaves behind
        if leftover.startswith("aioshmq-"):
            os.unlink(os.path.join("/dev/shm", leftover))
    last = (r.stdout.strip().splitlines() or ["?"])[-1]
    failures += r.returncode == 0
    print(
        f"{name}: {'CAUGHT' if r.returncode != 0 else 'MISSED'} -- {path}: {old.strip().splitlines()[0]!r} -> {new.strip().splitlines()[0]!r} -- {test} -- {last}",
        flush=True,
    )
sys.exit(1 if failures else 0)
