"""A reader spins only while spinning catches messages; otherwise it sleeps at once."""

from __future__ import annotations

import anyio
import pytest

import aioshmq
from aioshmq._spin import PROBE, PROBE_EVERY, Spin


def test_misses_halve_the_budget_down_to_nothing_and_hits_grow_it_slowly() -> None:
    spin = Spin(200e-6)
    assert spin.budget() == 200e-6
    for expected in (100e-6, 50e-6, 25e-6, 0.0):
        spin.miss()
        assert spin.now == pytest.approx(expected)
    spin.hit()
    assert spin.now == PROBE
    spin.hit()
    assert spin.now == pytest.approx(2 * PROBE)
    for _ in range(10):
        spin.hit()
    assert spin.now == 200e-6  # never above the limit
    assert (spin.caught, spin.missed) == (12, 4)


def test_with_nothing_left_it_tries_a_short_spin_now_and_then() -> None:
    spin = Spin(200e-6)
    while spin.now:
        spin.miss()
    budgets = [spin.budget() for _ in range(3 * PROBE_EVERY)]
    assert budgets.count(PROBE) == 3 and budgets.count(0.0) == 3 * PROBE_EVERY - 3
    assert budgets[PROBE_EVERY - 1] == PROBE
    spin.hit()  # the try caught one: spinning pays again
    assert spin.budget() == PROBE
    assert Spin(0.0).budget() == 0.0 and all(Spin(0.0).budget() == 0 for _ in range(100))


pytestmark = pytest.mark.anyio


async def test_a_reader_whose_spins_catch_nothing_stops_spinning() -> None:
    """Each message comes only once the reader is asleep: every spin is wasted CPU."""
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=0.0002) as r:
        got = []

        async def consume() -> None:
            for _ in range(8):
                got.append(await r.get())

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for i in range(8):
                await anyio.wait_all_tasks_blocked()  # the reader spun, then fell asleep
                await w.put(i)
        assert got == list(range(8))
        assert r._spinner.now == 0.0 and r._spinner.missed >= 4 and r._spinner.caught == 0


async def test_a_reader_whose_spins_catch_messages_keeps_spinning() -> None:
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=0.5) as r:
        got = []

        async def consume() -> None:
            for _ in range(20):
                got.append(await r.get())

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for i in range(20):
                await anyio.lowlevel.checkpoint()  # the reader is spinning now
                await w.put(i)
        assert got == list(range(20))
        assert r._spinner.caught >= 10 and r._spinner.missed == 0
        assert r._spinner.now == 0.5
