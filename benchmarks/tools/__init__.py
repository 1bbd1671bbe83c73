"""Measurement tools beside the bench, each run from a clone as a module:
``python -m benchmarks.tools.NAME [--help]``.

Each looks at one cost the bench's tables leave folded together; each uses aioshmq's public
API only, and measures the aioshmq the bench would (``AIOSHMQ_BENCH_TREE`` names a tree).  The
slow test tier runs each one briefly (tests/test_benchmark_tools.py), so they keep working;
none of those runs judges a figure.

- ``hotpath``: put and get in one process, nothing waiting: the per-message cost that bounds
  small-object throughput, next to bare pickle.
- ``call_cost``: instructions per awaited put or get under callgrind (valgrind): a figure that
  does not drift with the machine, so two builds compare on a shared VM.
- ``harness_floor``: what the bench's small rows cost before any transport (make, pickle,
  unpickle, check).
- ``broadcast_cpu``: the writer's and each reader's CPU per message in a broadcast.
- ``wake_cycle``: aioshmq's own sleep and wake-up path, two tasks in one loop.
- ``latency_pair``: a sleeping-peer round trip across processes against bare eventfd
  ping-pongs, with each side's CPU per trip.
- ``large_stream``: a large payload's time on each side of a ring, next to the bare copy.
- ``copy_floor``: moving a large payload between two processes with no queue at all.

``mutations.py`` and ``fuzz_sanitized.sh`` test the C core rather than measure it.
"""
