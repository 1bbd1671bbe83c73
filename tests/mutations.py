# ruff: noqa: E501 - one mutation a row reads best
"""Mutations: each removes a guaranteed behaviour, and the test named beside it must then
fail.  ``tests/test_mutations.py`` checks in the default tier that every row still names
code that exists (once), and in the slow tier that its test catches it.

A row: name, file, the code taken out, what replaces it, the test, and whether it is the
pure core's code (the test then runs with AIOSHMQ_PURE=1).  A row in a ``.c`` file is built
before its test runs.
"""

from __future__ import annotations

from typing import NamedTuple


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    test: str
    pure: bool = False


MUTATIONS = [
    Mutation(
        "a dead reader fails a waiting put",
        "aioshmq/ends/broker.py",
        "        dead = not (conn.bye or self.detach_dead)",
        "        dead = False",
        "tests/test_broker.py::test_dead_reader_fails_a_waiting_put",
    ),
    Mutation(
        "detach mode",
        "aioshmq/ends/broker.py",
        "        dead = not (conn.bye or self.detach_dead)",
        "        dead = not conn.bye",
        "tests/test_broker.py::test_dead_reader_detached",
    ),
    Mutation(
        "the broker watches a reader's process",
        "aioshmq/ends/broker.py",
        "        conn.pidfd = pidfd_of(conn.pid)",
        "        conn.pidfd = -1",
        "tests/test_broker.py::test_dead_reader_fails_a_waiting_put",
    ),
    Mutation(
        "a dead writer is told",
        "aioshmq/ends/reader.py",
        "            if not core.available():\n                self._writer_gone()\n            else:",
        "            if False:\n                self._writer_gone()\n            else:",
        "tests/test_broker.py::test_dead_writer",
    ),
    Mutation(
        "no lost wake-up: the reader looks again after announcing its sleep (pure)",
        "aioshmq/ring/pure.py",
        "        if self.available() or w[self._w_closed]:\n            w[self._r_sleep] = 0\n            return False",
        "        if False:\n            w[self._r_sleep] = 0\n            return False",
        "tests/test_notify.py::test_no_wake_up_is_lost",
        pure=True,
    ),
    Mutation(
        "no lost wake-up: the reader looks again after announcing its sleep (compiled)",
        "aioshmq/ring/compiled.c",
        "    if (r || ld(wword(m, W_CLOSED))) {",
        "    if (0) {",
        "tests/test_notify.py::test_no_wake_up_is_lost",
    ),
    Mutation(
        "a record is read only within the ring and the head (pure)",
        "aioshmq/ring/layout.py",
        "    if length > cap or end > cap or pos + end - off > head:",
        "    if False:",
        "tests/test_ring.py::test_scribbled_record",
        pure=True,
    ),
    Mutation(
        "a record is read only within the ring and the head (compiled)",
        "aioshmq/ring/compiled.c",
        "        if (length > cap || off + HEADER_SIZE + length > cap\n            || HEADER_SIZE + length > self->head - self->tail) {",
        "        if (0) {",
        "tests/test_ring.py::test_scribbled_record",
    ),
    Mutation(
        "a kind with a flag it does not take is corruption (pure)",
        "aioshmq/ring/format.py",
        "    return flags is not None and not kind & ~(KIND_MASK | flags)",
        "    return flags is not None",
        "tests/test_ring.py::test_scribbled_record",
        pure=True,
    ),
    Mutation(
        "a kind with a flag it does not take is corruption (compiled)",
        "aioshmq/ring/compiled.c",
        "        if (!KIND_KNOWN[kind]) {",
        "        if (!KIND_KNOWN[kind & KIND_MASK]) {",
        "tests/test_ring.py::test_scribbled_record",
    ),
    Mutation(
        "a buffer table of no buffers is corruption",
        "aioshmq/ring/layout.py",
        "    if not 1 <= n <= (size - 16) // 8:",
        "    if n > (size - 16) // 8:",
        "tests/test_ring.py::test_scribbled_record",
    ),
    Mutation(
        "an evicted reader the writer lapped is told so (pure)",
        "aioshmq/ring/pure.py",
        "        if mark := self._cwords[self._r_evicted]:\n            self._evicted(mark)\n        self.head = head",
        "        self.head = head",
        "tests/test_stuck.py::test_an_evicted_reader_the_writer_lapped_is_told_it_was_evicted",
        pure=True,
    ),
    Mutation(
        "an evicted reader the writer lapped is told so (compiled)",
        "aioshmq/ring/compiled.c",
        "    if (R_check_evicted_(self) < 0) return -1;\n    uint64_t head = ld_acquire(wword(&self->m, W_HEAD));",
        "    uint64_t head = ld_acquire(wword(&self->m, W_HEAD));",
        "tests/test_stuck.py::test_an_evicted_reader_the_writer_lapped_is_told_it_was_evicted",
    ),
    Mutation(
        "the gate's lock is held while the tails are read (pure)",
        "aioshmq/ring/pure.py",
        "    def __enter__(self) -> None:\n        self._lock.acquire()",
        "    def __enter__(self) -> None:\n        pass",
        "tests/test_ringcore.py::test_both_cores_read_the_gate_under_its_lock",
        pure=True,
    ),
    Mutation(
        "a cancelled atomic batch is rolled back",
        "aioshmq/ends/writer.py",
        "            if atomic:\n                ring.rollback(*start)",
        "            if False:\n                ring.rollback(*start)",
        "tests/test_writer.py::test_cancelled_multi_record_batch_publishes_nothing",
    ),
    Mutation(
        "a reader counts the messages it consumed",
        "aioshmq/ring/ring.py",
        "            self.core.consume(size, messages)",
        "            self.core.consume(size, 0)",
        "tests/test_model.py::test_model",
    ),
    Mutation(
        "a reader's wake-up fds are closed",
        "aioshmq/ends/reader.py",
        "        for fd in {*self._wake.fds(), *self._writer_wake.fds()}:\n            os.close(fd)",
        "        pass",
        "tests/test_end.py::test_no_leaks_over_1000_cycles",
    ),
    Mutation(
        "an end collected unclosed warns",
        "aioshmq/ends/end.py",
        '            _warn(f"unclosed {self!r}", ResourceWarning, source=self)',
        "            pass",
        "tests/test_end.py::test_garbage_collected_ends_warn_and_release",
    ),
    Mutation(
        "a bad capacity is refused",
        "aioshmq/ends/writer.py",
        '    capacity = _positive_int("capacity", capacity, L.MIN_CAPACITY)',
        "    pass",
        "tests/test_writer.py::test_bad_arguments",
    ),
    Mutation(
        "an interrupted get_sync clears its sleep flag",
        "aioshmq/ends/reader.py",
        "                finally:\n                    core.end_sleep()\n                self._check()",
        "                finally:\n                    pass\n                self._check()",
        "tests/test_end.py::test_keyboard_interrupt_in_get_sync",
    ),
    Mutation(
        "nothing survives SIGKILL (memfd, not /dev/shm)",
        "aioshmq/memory/segment.py",
        '        fd = os.memfd_create(f"aioshmq:{name}", os.MFD_CLOEXEC)',
        '        fd = os.open(f"/dev/shm/aioshmq-{name}", os.O_RDWR | os.O_CREAT, 0o600)',
        "tests/test_segment.py::test_nothing_survives_sigkill_of_every_process",
    ),
    Mutation(
        "a wake-up nobody waits for does not spin the loop",
        "aioshmq/ends/end.py",
        "            self._unregister()\n            return\n        self._wake.drain()",
        "            return\n        self._wake.drain()",
        "tests/test_end.py::test_wake_ups_nobody_waits_for_neither_spin_the_loop_nor_get_lost",
    ),
    Mutation(
        "close wakes the holders while they cannot let the fds go",
        "aioshmq/ends/end.py",
        "            if self._blockers or foreign:\n                # Under the lock: a holder that leaves meanwhile cannot release (close) the\n                # fd this writes to until the lock is let go.\n                self._interrupt()\n        if foreign:",
        "        if self._blockers or foreign:\n            self._interrupt()\n        if foreign:",
        "tests/test_end.py::test_a_close_never_signals_an_fd_a_leaving_call_let_go",
    ),
    Mutation(
        "blocking calls are refused in an event loop",
        "aioshmq/ends/end.py",
        "        if in_event_loop():\n            raise RuntimeError(",
        "        if False:\n            raise RuntimeError(",
        "tests/test_end.py::test_blocking_calls_are_refused_in_a_running_loop",
    ),
    Mutation(
        "a fork-inherited end says to pass the handle",
        "aioshmq/ends/end.py",
        "        if self._forked:\n            return anyio.ClosedResourceError(",
        "        if False:\n            return anyio.ClosedResourceError(",
        "tests/test_coroutines.py::test_a_writer_inherited_through_fork_says_to_pass_the_handle",
    ),
    Mutation(
        "get raises a pending cancellation first",
        "aioshmq/ends/reader.py",
        "            or pending_checkpoint() is not None\n",
        "",
        "tests/test_cancel.py::test_every_await_raises_a_pending_cancellation",
    ),
    Mutation(
        "put raises a pending cancellation first",
        "aioshmq/ends/writer.py",
        "        if pending_checkpoint() is not None or _monotonic() >= self._next_yield:",
        "        if _monotonic() >= self._next_yield:",
        "tests/test_cancel.py::test_every_await_raises_a_pending_cancellation",
    ),
    Mutation(
        "a deadline that just passed stops a call",
        "aioshmq/ends/cancel.py",
        "                        if scope._deadline != _INF and scope._deadline <= loop.time():",
        "                        if False:",
        "tests/test_cancel.py::test_a_deadline_that_just_passed_stops_a_call",
    ),
    Mutation(
        "an untested anyio is read through its public API",
        "aioshmq/ends/cancel.py",
        "    if not ANYIO_TESTED[0] <= _anyio_version() <= ANYIO_TESTED[1] or _current_tasks is None:",
        "    if _current_tasks is None:",
        "tests/test_cancel.py::test_an_anyio_not_tested_is_read_through_its_public_api",
    ),
    Mutation(
        "a reader closed from inside its own get says it is closed",
        "aioshmq/ends/reader.py",
        "            if self._closed:  # by the message's own code, or another thread: hands off\n                raise self._closed_error()\n",
        "",
        "tests/test_coroutines.py::test_a_reader_closed_from_inside_its_own_get_says_it_is_closed",
    ),
    Mutation(
        "a reducer pickle would ignore is refused",
        "aioshmq/serialize/pickling.py",
        "        if cls in _OWN_TYPES:",
        "        if False:",
        "tests/test_serialize.py::test_a_reducer_for_a_type_pickle_writes_itself_is_refused",
    ),
    Mutation(
        "only numpy's own ndarray goes the arrays' way (pure)",
        "aioshmq/ring/pure.py",
        "        if np is not None and type(obj) is np.ndarray:",
        '        if type(obj).__name__ == "ndarray":',
        "tests/test_serialize.py::test_an_object_of_a_class_named_numpy_ndarray_is_pickled_as_any_other",
        pure=True,
    ),
    Mutation(
        "no select() on fds above 1023",
        "aioshmq/ends/reader.py",
        "    poller = select.poll()\n    poller.register(fd, select.POLLIN)\n    return bool(poller.poll(int(timeout * 1000)))",
        "    return bool(select.select([fd], [], [], timeout)[0])",
        "tests/test_reader.py::test_fd_numbers_above_1023",
    ),
    Mutation(
        "drop_reader never drops a live reader",
        "aioshmq/ring/ring.py",
        "            if self.gate.state(index) == F.ATTACHED:\n                raise Busy(",
        "            if False:\n                raise Busy(",
        "tests/test_broker.py::test_drop_reader",
    ),
    Mutation(
        "a reader checks the writer's uid",
        "aioshmq/ends/broker.py",
        "        if uid != me and uid not in trusted_uids:",
        "        if False:",
        "tests/test_broker.py::test_reader_refuses_a_ring_served_by_another_user",
    ),
    Mutation(
        "the broker refuses a malformed request",
        "aioshmq/ends/broker.py",
        '    except Exception:  # not JSON (nested too deep, say), not an object, no "reader"',
        "    except ValueError:",
        "tests/test_broker.py::test_broker_survives_any_request",
    ),
    Mutation(
        "a failed connect leaves the slot as it was",
        "aioshmq/ends/broker.py",
        "        self.ring.restore(index, state)",
        "        pass",
        "tests/test_broker.py::test_connect_that_fails_after_the_slot_changed_hands_gives_it_back",
    ),
    Mutation(
        "rpc: one batch per loop turn",
        "aioshmq/rpc/__init__.py",
        "                await self._calls.put_many(messages)",
        "                for message in messages:\n                    await self._calls.put(message)",
        "tests/test_rpc.py::test_a_batch_is_one_publish_and_one_wake_up",
    ),
    Mutation(
        "rpc: a cancelled call is withdrawn",
        "aioshmq/rpc/__init__.py",
        "        except BaseException:\n            self.cancel()\n            raise",
        "        except BaseException:\n            raise",
        "tests/test_rpc.py::test_cancelled_call_is_withdrawn_and_its_late_reply_dropped",
    ),
    Mutation(
        "rpc: a withdrawal cuts the awaited method short",
        "aioshmq/rpc/__init__.py",
        "                    self.scope.cancel()  # the method sees the cancellation where it waits",
        "                    pass",
        "tests/test_rpc_cancel.py::test_a_timed_out_async_call_is_cancelled_in_the_workers",
    ),
    Mutation(
        "rpc: a withdrawn queued call is skipped",
        "aioshmq/rpc/__init__.py",
        "                    self.withdrawn.add(cid)",
        "                    pass",
        "tests/test_rpc_cancel.py::test_withdrawn_queued_calls_never_run",
    ),
    Mutation(
        "rpc: a busy worker looks for withdrawals between calls",
        "aioshmq/rpc/__init__.py",
        "                    cut = self.poll(cid) or cut",
        "                    pass",
        "tests/test_rpc_cancel.py::test_a_withdrawn_plain_method_runs_to_its_end_and_the_worker_is_then_free",
    ),
    Mutation(
        "rpc: a client refuses another event loop",
        "aioshmq/rpc/__init__.py",
        '        if threading.get_ident() != self._thread or _running_loop() is not self._loop:\n            self._check_loop("submit a call")',
        "        pass",
        "tests/test_rpc_loops.py::test_a_client_refuses_another_event_loop_of_its_thread",
    ),
    Mutation(
        "rpc: a dead worker fails the calls",
        "aioshmq/rpc/__init__.py",
        '            except PeerDied as exc:\n                self._fail(_worker_died(rank, exc.pid, ""))',
        "            except PeerDied as exc:\n                await anyio.sleep_forever()",
        "tests/test_rpc.py::test_dead_worker_fails_pending_and_later_calls",
    ),
    Mutation(
        "remote: the writer reuses only what was acknowledged",
        "aioshmq/remote/_server.py",
        "            ring.release_to(pos, count)",
        "            ring.release_to(ring.core.tail, ring.core.count)",
        "tests/test_remote_server.py::test_the_writer_reuses_only_what_a_remote_reader_acknowledged",
    ),
    Mutation(
        "remote: duplicates after a reconnection are dropped",
        "aioshmq/remote/_link.py",
        "    if end_pos <= expect[0]:\n        return None",
        "    if False:\n        return None",
        "tests/test_remote_wire.py::test_what_arrives_twice_is_dropped_by_position",
    ),
    Mutation(
        "remote: the ZAP check refuses a key without the secret",
        "aioshmq/remote/_auth.py",
        '        ok = mechanism == b"CURVE" and credentials == [z85.decode(keys.client_public)]',
        '        ok = mechanism == b"CURVE"',
        "tests/test_remote_link.py::test_wrong_or_missing_secret_is_refused_and_the_writer_serves_on",
    ),
    Mutation(
        "remote: a silent reader is a dead reader",
        "aioshmq/remote/_server.py",
        "                if now - remote.heard > remote.heartbeat:",
        "                if False:",
        "tests/test_remote_server.py::test_a_killed_remote_reader_is_a_dead_reader",
    ),
    Mutation(
        "remote: data messages are checked",
        "aioshmq/remote/_wire.py",
        "        if off + n > size:",
        "        if False:",
        "tests/test_remote_wire.py::test_a_scribbled_run_is_refused",
    ),
]
