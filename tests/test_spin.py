"""A reader spins only while spinning catches messages; otherwise it sleeps at once."""

from __future__ import annotations

import os

import anyio
import pytest

import aioshmq
from aioshmq.ends.spin import PROBE, PROBE_EVERY, PROBE_EVERY_MOST, PROBE_MARGIN, SLEEP_WEIGHT, Spin


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
    spin.hit()  # the try caught one: spinning pays again, from the try's length on
    assert spin.budget() == pytest.approx(2 * PROBE)
    assert Spin(0.0).budget() == 0.0 and all(Spin(0.0).budget() == 0 for _ in range(100))


def _spent(spin: Spin) -> Spin:
    while spin.now:
        spin.miss()
    return spin


def test_a_try_lasts_as_long_as_the_recent_short_sleeps() -> None:
    """Messages 60 us apart: a 25 us try could never catch one, a try as long as the
    sleeps it replaces can, and once it does the budget starts from there."""
    spin = _spent(Spin(200e-6))
    for _ in range(8):
        spin.slept(60e-6)
    assert spin.slept_mean == pytest.approx(60e-6)
    budgets = [spin.budget() for _ in range(PROBE_EVERY)]
    assert budgets[:-1] == [0.0] * (PROBE_EVERY - 1)
    assert budgets[-1] == pytest.approx(PROBE_MARGIN * 60e-6)
    spin.hit()
    assert spin.now == pytest.approx(PROBE_MARGIN * 60e-6 + PROBE)
    spin.miss()  # a try that runs out halves as any spin does
    assert spin.now == pytest.approx((PROBE_MARGIN * 60e-6 + PROBE) / 2)


def test_failed_tries_come_ever_more_rarely_until_one_catches_a_message() -> None:
    """Where no spin can catch anything (both processes on one CPU), each failed try
    doubles the sleeps before the next, up to a bound; a try that catches resets them."""
    spin = _spent(Spin(200e-6))
    gaps = []
    for _ in range(8):
        sleeps = 1
        while not spin.budget():
            sleeps += 1
        gaps.append(sleeps)
        spin.miss()
    assert gaps == [PROBE_EVERY * 2**i for i in range(6)] + [PROBE_EVERY_MOST] * 2
    while not spin.budget():
        pass
    spin.hit()
    assert spin.every == PROBE_EVERY and spin.now == pytest.approx(2 * PROBE)
    spin.miss()  # a spin that is not a try changes nothing about tries
    assert spin.every == PROBE_EVERY


def test_a_skipped_spin_leaves_no_budget_and_puts_the_next_try_off() -> None:
    """Checked first are the first spin and every try; a skipped try counts for the next
    one's gap as a failed one does, without counting as a spin."""
    spin = Spin(200e-6)
    assert spin.fresh() and spin.budget() == 200e-6
    spin.skip()
    assert spin.now == 0.0 and spin.every == PROBE_EVERY and spin.skipped == 1
    gaps = []
    for _ in range(3):
        sleeps = 1
        while not spin.budget():
            sleeps += 1
        assert spin.fresh()
        gaps.append(sleeps)
        spin.skip()
    assert gaps == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]
    assert (spin.caught, spin.missed, spin.skipped) == (0, 0, 4)
    while not spin.budget():
        pass
    spin.hit()
    assert not spin.fresh()  # spinning pays: no check before each spin
    assert spin.every == PROBE_EVERY


def test_the_mean_follows_the_sleeps_and_ignores_long_ones() -> None:
    spin = _spent(Spin(200e-6))
    spin.slept(1.0)  # longer than the limit: no spin would have caught it
    assert spin.slept_mean == 0.0
    spin.slept(40e-6)
    spin.slept(80e-6)
    assert spin.slept_mean == pytest.approx(40e-6 + SLEEP_WEIGHT * 40e-6)
    spin.slept(300e-6)
    assert spin.slept_mean == pytest.approx(40e-6 + SLEEP_WEIGHT * 40e-6)
    tries = [spin.budget() for _ in range(PROBE_EVERY)]
    assert tries[-1] == pytest.approx(PROBE_MARGIN * (40e-6 + SLEEP_WEIGHT * 40e-6))
    long_sleeper = _spent(Spin(200e-6))
    long_sleeper.slept(190e-6)  # a try never spins past the limit
    assert [long_sleeper.budget() for _ in range(PROBE_EVERY)][-1] == 200e-6


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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move between")
async def test_a_reader_on_its_writers_only_cpu_never_spins() -> None:
    """This process writes and reads: pinned to one CPU, the writer could only run where
    the reader would spin, so the first spin and every try are skipped and the reader sleeps
    at once; unpinned, the next try is made."""
    cpus = os.sched_getaffinity(0)
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name, spin=0.0002) as r:
        spinner = r._spinner
        os.sched_setaffinity(0, {min(cpus)})
        try:
            budgets = [r._spin_budget() for _ in range(1 + PROBE_EVERY + 2 * PROBE_EVERY)]
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put, "after a sleep")
                assert await r.get() == "after a sleep"
        finally:
            os.sched_setaffinity(0, cpus)
        assert set(budgets) == {0.0}
        assert (spinner.caught, spinner.missed, spinner.skipped) == (0, 0, 3)
        assert spinner.every == 4 * PROBE_EVERY  # each skipped try put the next one off
        spinner.every = 1
        assert r._spin_budget() > 0  # a CPU may be free for it now: the try is made
        assert spinner.skipped == 3
