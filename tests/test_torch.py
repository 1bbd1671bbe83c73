"""CPU torch tensors out of band: every dtype and layout, read-only leases, errors, rpc."""

from __future__ import annotations

import ctypes
import os
import pickle
import resource
import signal
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from conftest import BACKENDS_ASYNCIO_FIRST, Children, backend_name, run_backend

import aioshmq
from aioshmq import rpc
from aioshmq.serialize.pickling import PickleSerializer

torch = pytest.importorskip("torch")

from aioshmq.serialize import tensors as _torch  # noqa: E402  (needs torch)

pytestmark = pytest.mark.anyio

TIMEOUT = 60  # seconds for any one wait on a child process (spawn imports torch afresh)

# torch warns (once a process) when it makes these; the tests make them on purpose.
_TORCH_WARNINGS = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype stage:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning"),
    # torch's own unpickling of a quantized tensor (plain pickle.loads warns the same)
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:Sparse invariant checks are implicitly disabled:UserWarning"
    ),
]


def _with_torch_warnings_ignored(test: Any) -> Any:
    for mark in _TORCH_WARNINGS:
        test = mark(test)
    return test


def _all_dtypes() -> list[Any]:
    """Every ``torch.dtype`` that is an attribute of ``torch`` (aliases once)."""
    found: dict[Any, None] = {}
    for name in sorted(dir(torch)):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            found.setdefault(value, None)
    return list(found)


def _makeable(dtype: Any) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental", quantized "deprecated"
        try:
            torch.empty((5, 3), dtype=dtype)
        except Exception:
            return False
    return True


def _random(dtype: Any, shape: tuple[int, ...] = (5, 3)) -> Any:
    """A tensor of ``dtype`` and ``shape`` holding random bytes (NaNs, odd bools and all)."""
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _same_bytes(got: Any, sent: Any) -> bool:
    """Same dtype, shape, strides and bytes (NaN-safe: compared as bytes)."""
    return (
        got.dtype == sent.dtype
        and got.shape == sent.shape
        and got.stride() == sent.stride()
        and torch.equal(got.view(torch.uint8), sent.view(torch.uint8))
    )


def _ring_span(r: aioshmq.Reader[Any]) -> tuple[int, int]:
    """The addresses of the reader's whole mapping of the ring: [start, end)."""
    mapping = r._seg._map
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        start = ctypes.addressof(anchor)
    finally:
        del anchor  # its export of the mapping ends here
    return start, start + len(mapping)


def _inside(t: Any, span: tuple[int, int]) -> bool:
    start, end = span
    return start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end


# -- every dtype ------------------------------------------------------------------------------


_DTYPES = _all_dtypes()
_SKIPPED = [dt for dt in _DTYPES if not _makeable(dt)]  # what torch.empty cannot make here
_QUANTIZED = [torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4]


@_with_torch_warnings_ignored
async def test_every_dtype_round_trips_with_its_exact_bytes() -> None:
    dtypes = [dt for dt in _DTYPES if dt not in _SKIPPED]
    assert {torch.float32, torch.bfloat16, torch.bool, torch.complex128} <= set(dtypes)
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name) as r:
        for dt in dtypes:
            sent = _random(dt)
            await w.put(sent)
            await w.put(sent)
            got = await r.get()
            assert _same_bytes(got, sent), dt
            async with r.lease() as leased:
                assert _same_bytes(leased, sent), dt
                del leased
            # A 0-dim scalar and an empty tensor of every dtype too.
            scalar = _random(dt, ())
            await w.put(scalar)
            got_scalar = await r.get()
            assert got_scalar.dtype == dt and got_scalar.shape == () and got_scalar.stride() == ()
            assert torch.equal(
                got_scalar.reshape(1).view(torch.uint8), scalar.reshape(1).view(torch.uint8)
            ), dt
            if dt in _QUANTIZED:
                continue  # see test_empty_tensor_of_a_quantized_dtype
            await w.put(_random(dt, (0, 4)))
            empty = await r.get()
            assert empty.dtype == dt and empty.shape == (0, 4) and empty.stride() == (4, 1), dt


@_with_torch_warnings_ignored
@pytest.mark.parametrize("dtype", _QUANTIZED, ids=str)
async def test_quantized_tensors_take_torchs_own_path(dtype: Any) -> None:
    per_tensor = torch.quantize_per_tensor(torch.randn(5, 4), 0.1, 2, dtype)
    sent = [per_tensor]
    if dtype in (torch.quint8, torch.qint8, torch.qint32):
        sent.append(
            torch.quantize_per_channel(
                torch.randn(5, 4),
                torch.tensor([0.1, 0.2, 0.3, 0.4]),
                torch.tensor([0, 1, 2, 3]),
                1,
                dtype,
            )
        )
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        for q in sent:
            await w.put(q)
            got = await r.get()
            assert got.is_quantized and got.dtype == dtype and got.shape == q.shape
            assert got.qscheme() == q.qscheme()
            # torch.equal is unreliable for the packed quint2x4 (even after torch's own pickle):
            # the integers and the dequantized values say it.
            assert torch.equal(got.int_repr(), q.int_repr())
            assert torch.equal(got.dequantize(), q.dequantize())


# -- out of band ------------------------------------------------------------------------------


def test_a_tensor_is_one_buffer_beside_a_small_pickle() -> None:
    t = torch.randn(1000, 10)
    main, buffers = PickleSerializer().dumps(t)
    assert len(buffers) == 1 and buffers[0].nbytes == t.nbytes == 40_000
    assert len(main) < 400  # dtype name, shape, strides: no data
    assert bytes(buffers[0]) == t.numpy().tobytes()
    # The same tensor twice in one message: its bytes once, one tensor again.
    main, buffers = PickleSerializer().dumps([t, t])
    assert len(buffers) == 1
    a, b = pickle.loads(main, buffers=[bytearray(buffers[0])])
    assert a is b and torch.equal(a, t)


def test_torch_is_seen_once_imported_and_reducers_stay_per_serializer() -> None:
    ser = PickleSerializer()
    assert ser.pickler is not pickle.dumps  # torch is imported here: its reducer is in
    assert ser._table[torch.Tensor] is _torch.reduce_tensor
    # A reducer of one's own for tensors replaces it, for that serializer alone.
    calls: list[Any] = []

    def mine(t: Any) -> Any:
        calls.append(t)
        return (torch.zeros, (tuple(t.shape),))

    own = PickleSerializer(reducers={torch.Tensor: mine})
    main, buffers = own.dumps(torch.ones(2, 2))
    assert len(calls) == 1 and buffers == []
    assert torch.equal(pickle.loads(main), torch.zeros(2, 2))
    assert len(PickleSerializer().dumps(torch.ones(2, 2))[1]) == 1


async def test_megabytes_put_and_get_and_larger_than_the_ring() -> None:
    big = torch.randn(1 << 20)  # 4 MiB, whole in a 16 MiB ring
    huge = torch.randint(-128, 128, (3 << 20,), dtype=torch.int8)  # 3 MiB: in fragments
    with aioshmq.create(capacity=1 << 24) as w, aioshmq.connect(w.name) as r:
        await w.put(big)
        got = await r.get()
        assert got.shape == big.shape and torch.equal(got, big)
    with aioshmq.create(capacity=1 << 20) as w, aioshmq.connect(w.name) as r:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.put_many, [huge, huge])
                assert torch.equal(await r.get(), huge)
                async with r.lease() as leased:
                    assert torch.equal(leased, huge)
                    del leased


async def test_lease_is_the_ring_itself_and_get_is_a_private_copy() -> None:
    sent = torch.randn(256, 256)  # 256 KiB
    with aioshmq.create(capacity=1 << 22, readers=2) as w:
        with aioshmq.connect(w.name, 0) as r0, aioshmq.connect(w.name, 1) as r1:
            span = _ring_span(r0)
            await w.put(sent)
            await w.put(sent)
            async with r0.lease() as leased:
                assert torch.equal(leased, sent)
                assert _inside(leased, span)  # built on the ring's memory: no copy
                assert ctypes.string_at(leased.data_ptr(), leased.nbytes) == sent.numpy().tobytes()
                del leased
            got = await r0.get()
            assert torch.equal(got, sent) and not _inside(got, span)
            got.fill_(0)  # its own writable memory: the ring and the other reader see nothing
            got[0, 0] = 1
            assert got.sum().item() == 1
            for _ in range(2):
                assert torch.equal(await r1.get(), sent)
            assert w.statistics().messages_in_ring == 0


# -- layouts ----------------------------------------------------------------------------------


def _layouts() -> list[Any]:
    """(id, tensor, strides it arrives with)."""
    c = torch.randn(3, 4, dtype=torch.complex64)
    conj, neg = c.conj(), c.conj().imag
    assert conj.is_conj() and neg.is_neg()  # views with torch's lazy conj and neg bits
    base = torch.randn(6, 4)
    cases = [
        ("contiguous", torch.randn(4, 5), (5, 1)),
        ("transposed", torch.randn(4, 5).t(), (1, 5)),
        ("permuted-3d", torch.randn(2, 3, 4).permute(2, 0, 1), (1, 12, 4)),
        (
            "channels-last",
            torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
            (60, 1, 15, 3),
        ),
        ("offset-slice", base[2:], (4, 1)),
        ("gaps", base[::2], (4, 1)),
        ("gaps-columns", base[:, 1::2], (2, 1)),
        ("expanded", torch.randn(1, 4).expand(3, 4), (4, 1)),
        ("conj", conj, (4, 1)),
        ("neg", neg, (4, 1)),
        ("zero-size", torch.empty(0, 4), (4, 1)),
        ("scalar", torch.tensor(3.5), ()),
        ("bool", torch.rand(3, 3) > 0.5, (3, 1)),
    ]
    return [pytest.param(t, strides, id=name) for name, t, strides in cases]


@pytest.mark.parametrize(("sent", "strides"), _layouts())
async def test_layouts_arrive_equal_with_their_strides(sent: Any, strides: tuple[int, ...]) -> None:
    main, buffers = PickleSerializer().dumps(sent)
    # Only the tensor's own elements travel (a slice's, not its base's), never twice.
    assert sum(b.nbytes for b in buffers) == sent.numel() * sent.element_size()
    assert len(main) < 400
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(sent)
        await w.put(sent)
        got = await r.get()
        assert got.shape == sent.shape and got.dtype == sent.dtype and torch.equal(got, sent)
        assert got.stride() == strides
        assert not got.is_conj() and not got.is_neg()  # resolved on the way
        if got.dtype == torch.bool:  # writable, its own memory
            got.logical_not_()
        else:
            got.add_(1)
        async with r.lease() as leased:
            assert leased.shape == sent.shape and torch.equal(leased, sent)
            assert leased.stride() == strides
            del leased


async def test_expanded_tensor_arrives_with_rows_of_its_own() -> None:
    sent = torch.arange(4.0).expand(3, 4)
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(sent)
        got = await r.get()
        got[0, 0] = 100  # made contiguous once: the rows no longer alias each other
        assert got[1, 0].item() == 0 and got[0, 0].item() == 100


async def test_channels_last_stays_channels_last() -> None:
    sent = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(sent)
        got = await r.get()
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert not got.is_contiguous()
        assert torch.equal(got, sent)


async def test_requires_grad_and_parameters() -> None:
    leaf = torch.randn(3, 4, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(2, 2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put({"leaf": leaf, "param": param, "frozen": frozen, "plain": torch.ones(2)})
        got = await r.get()
        x = got["leaf"]
        assert type(x) is torch.Tensor and x.requires_grad and x.is_leaf and x.grad_fn is None
        assert torch.equal(x.detach(), leaf.detach())
        (x * 3).sum().backward()  # grad flows into the received leaf
        assert torch.equal(x.grad, torch.full((3, 4), 3.0))
        assert leaf.grad is None  # and not into the sender's
        p = got["param"]
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert torch.equal(p.detach(), param.detach())
        f = got["frozen"]
        assert isinstance(f, torch.nn.Parameter) and not f.requires_grad
        assert not got["plain"].requires_grad
        # In a lease as well.
        await w.put((leaf, param))
        async with r.lease() as (x, p):
            assert x.requires_grad and x.is_leaf and isinstance(p, torch.nn.Parameter)
            (x.sum() + p.sum()).backward()
            assert torch.equal(x.grad, torch.ones(3, 4)) and torch.equal(p.grad, torch.ones(2, 2))
            del x, p


async def test_containers_batches_and_shared_references() -> None:
    a, b, c = torch.randn(3), torch.arange(6).reshape(2, 3), torch.randn(2, 2).t()
    message = {"a": a, "list": [b, (c, "x")], "again": a}
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put(message)
        got = await r.get()
        assert torch.equal(got["a"], a) and torch.equal(got["list"][0], b)
        assert torch.equal(got["list"][1][0], c) and got["list"][1][0].stride() == c.stride()
        assert got["list"][1][1] == "x"
        assert got["again"] is got["a"]  # one tensor, sent once, arrives once
        batch = [a, {"b": b}, (c,), [a, a], 7]
        await w.put_many(batch)
        got_batch = [await r.get() for _ in batch]
        assert torch.equal(got_batch[0], a) and torch.equal(got_batch[1]["b"], b)
        assert torch.equal(got_batch[2][0], c) and got_batch[2][0].stride() == (1, 2)
        assert got_batch[3][0] is got_batch[3][1] and torch.equal(got_batch[3][0], a)
        assert got_batch[4] == 7
        await w.put_many([a, b])
        for sent in (a, b):  # a batch is leased as a copy, one message at a time
            async with r.lease() as leased:
                assert torch.equal(leased, sent)
                del leased


def test_one_element_with_a_stride() -> None:
    sent = torch.randn(1, 3)[:, 0]  # shape (1,), stride (3,); torch's own pickle takes it
    assert torch.equal(pickle.loads(pickle.dumps(sent)), sent)
    main, buffers = PickleSerializer().dumps(sent)
    assert torch.equal(pickle.loads(main, buffers=buffers), sent)


@_with_torch_warnings_ignored
def test_empty_tensor_of_a_quantized_dtype() -> None:
    sent = torch.empty(0, dtype=torch.uint8).view(torch.qint8)
    assert not sent.is_quantized and pickle.loads(pickle.dumps(sent)).shape == (0,)
    main, buffers = PickleSerializer().dumps(sent)
    got = pickle.loads(main, buffers=buffers)
    assert got.dtype == torch.qint8 and got.shape == (0,)


# -- sparse, nested, quantized: torch's own pickling ------------------------------------------


def _validate_sparse() -> None:
    """What torch.load does after loading: check the sparse tensors pickle rebuilt, and let
    go of them (torch._utils keeps each one in a list until then; plain pickle never calls it)."""
    torch._utils._validate_loaded_sparse_tensors()
    assert torch._utils._sparse_tensors_to_validate == []


@_with_torch_warnings_ignored
async def test_sparse_nested_and_quantized_arrive_equal() -> None:
    dense = torch.randn(4, 5) * (torch.rand(4, 5) > 0.5)
    coo = dense.to_sparse()
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 1], [2, 2, 0]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3)
    )
    csr = dense.to_sparse_csr()
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    quantized = torch.quantize_per_tensor(torch.randn(3, 3), 0.05, 7, torch.quint8)
    _, buffers = PickleSerializer().dumps(coo)
    assert len(buffers) == 2  # torch's reduction, whose indices and values are tensors again
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        try:
            await w.put_many([coo, uncoalesced, csr, nested, quantized])
            got = await r.get()
            assert got.layout == torch.sparse_coo and torch.equal(got.to_dense(), dense)
            got = await r.get()
            assert got.layout == torch.sparse_coo and not got.is_coalesced()
            assert torch.equal(got.to_dense(), uncoalesced.to_dense())
            got = await r.get()
            assert got.layout == torch.sparse_csr and torch.equal(got.to_dense(), dense)
            got = await r.get()
            assert got.is_nested
            pairs = zip(got.unbind(), nested.unbind(), strict=True)
            assert all(torch.equal(x, y) for x, y in pairs)
            got = await r.get()
            assert got.is_quantized and torch.equal(got, quantized)
            assert (got.q_scale(), got.q_zero_point()) == (0.05, 7)
            await w.put(coo)  # a lease too
            async with r.lease() as leased:
                assert torch.equal(leased.to_dense(), dense)
                del leased
        finally:
            _validate_sparse()  # a failed assertion above must not leave the lease's tensor


@_with_torch_warnings_ignored
async def test_received_sparse_tensors_are_not_kept_by_torch() -> None:
    _validate_sparse()
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        try:
            for _ in range(3):
                await w.put(torch.eye(3).to_sparse())
                got = await r.get()
                del got
                assert torch._utils._sparse_tensors_to_validate == []
            await w.put(torch.eye(3).to_sparse())
            async with r.lease() as leased:
                assert torch.equal(leased.to_dense(), torch.eye(3))
                assert torch._utils._sparse_tensors_to_validate == []  # nor the ring's memory
        finally:
            _validate_sparse()


# -- not on the CPU ---------------------------------------------------------------------------


async def test_meta_tensor_is_refused_and_the_ring_goes_on() -> None:
    meta = torch.empty(3, 4, device="meta")
    with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
        await w.put("before")
        with pytest.raises(aioshmq.SerializationError, match="'meta' device") as info:
            await w.put({"x": meta})
        assert isinstance(info.value, TypeError)
        assert isinstance(info.value.__cause__, TypeError)
        assert "send its shape and dtype" in str(info.value)
        with pytest.raises(TypeError, match="'meta' device"):
            w.put_nowait(meta)
        with pytest.raises(TypeError, match="'meta' device"):
            await w.put_many([1, meta, 2])  # all or nothing: 1 is not sent either
        stats = w.statistics()
        assert stats.messages_in_ring == 1 and stats.messages_put == 1
        await w.put(torch.arange(3))
        assert await r.get() == "before"
        assert torch.equal(await r.get(), torch.arange(3))
        with pytest.raises(aioshmq.Empty):
            r.get_nowait()


class _FakeCuda(torch.Tensor):
    """A tensor that says it is on cuda:0 and has no memory (a CPU build makes no CUDA one)."""

    @staticmethod
    def __new__(cls) -> Any:
        make = torch.Tensor._make_wrapper_subclass
        return make(cls, (2, 3), dtype=torch.float32, device="cuda:0")

    @classmethod
    def __torch_dispatch__(cls, func: Any, kinds: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} on a stand-in")


def _says_copy_to_cpu(exc: BaseException) -> None:
    text = str(exc)
    assert "cuda:0" in text and "copy it to the CPU" in text and "tensor.cpu()" in text
    assert "torch.multiprocessing" in text


async def test_cuda_tensor_message_says_copy_to_the_cpu() -> None:
    stand_in = types.SimpleNamespace(device=torch.device("cuda:0"))
    error = _torch.not_on_cpu(stand_in)  # type: ignore[arg-type]
    assert isinstance(error, TypeError)
    _says_copy_to_cpu(error)
    with pytest.raises(TypeError) as info:
        _torch.reduce_tensor(stand_in)  # type: ignore[arg-type]
    _says_copy_to_cpu(info.value)
    # A real tensor subclass on cuda:0 (no memory behind it), through a writer whose
    # serializer reduces it as a tensor: refused at put, and the ring goes on.
    fake = _FakeCuda()
    assert fake.device == torch.device("cuda:0")
    ser = PickleSerializer(reducers={_FakeCuda: _torch.reduce_tensor})
    with aioshmq.create(capacity=1 << 16, serializer=ser) as w, aioshmq.connect(w.name) as r:
        with pytest.raises(aioshmq.SerializationError) as info:
            await w.put([fake])
        _says_copy_to_cpu(info.value)
        await w.put(torch.ones(2))
        assert torch.equal(await r.get(), torch.ones(2))


# -- torch only when a tensor is seen ---------------------------------------------------------


_NO_TORCH = textwrap.dedent(
    """
    import sys

    import anyio
    import numpy as np

    import aioshmq

    async def main():
        with aioshmq.create(capacity=1 << 16) as w, aioshmq.connect(w.name) as r:
            await w.put({"a": 1, "b": [2.5, "x"]})
            await w.put(np.arange(10))
            await w.put_many([np.ones(3), {"k": np.zeros(2)}])
            assert await r.get() == {"a": 1, "b": [2.5, "x"]}
            assert np.array_equal(await r.get(), np.arange(10))
            assert np.array_equal(await r.get(), np.ones(3))
            assert np.array_equal((await r.get())["k"], np.zeros(2))
            await w.put(np.arange(4))
            async with r.lease() as got:
                assert np.array_equal(got, np.arange(4))
                del got
            leaked = sorted(m for m in sys.modules if m == "torch" or "_torch" in m)
            assert not leaked, leaked
            print("no torch")
            # Imported late, torch is seen by the writer already open: out of band.
            import torch
            t = torch.randn(100, 7).t()
            await w.put(t)
            got = await r.get()
            assert torch.equal(got, t) and got.stride() == t.stride()
            assert "aioshmq.serialize.tensors" in sys.modules
            print("then torch")

    anyio.run(main)
    """
)


@pytest.mark.timeout(120)
def test_torch_is_imported_only_when_a_tensor_is_seen() -> None:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", _NO_TORCH],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["no", "torch", "then", "torch"]


# -- read-only leases, across processes -------------------------------------------------------


def _lease_and_write(name: str, backend: str) -> None:
    """Reader 0: lease the tensor and write into it.  The ring is mapped read-only here,
    so the process dies by SIGSEGV; exit code 3 says the write went through."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file for the expected crash

    async def main() -> None:
        with aioshmq.connect(name, reader=0) as r:
            async with r.lease() as t:
                if not torch.equal(t, torch.arange(16384, dtype=torch.float32)):
                    os._exit(4)
                t.fill_(-1.0)
                os._exit(3)

    run_backend(backend, main)
    os._exit(5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", BACKENDS_ASYNCIO_FIRST)
async def test_writing_into_a_leased_tensor_kills_only_the_writer_of_it(
    anyio_backend: object, children: Children
) -> None:
    """start method: spawn.  Reader 0 (a child) dies writing into its lease; reader 1 gets
    the message unchanged; the writer sees the death and goes on without it."""
    sent = torch.arange(16384, dtype=torch.float32)  # 64 KiB
    with aioshmq.create(capacity=1 << 20, max_messages=4, readers=2) as w:
        with aioshmq.connect(w.name, 1) as other:
            proc = await anyio.to_thread.run_sync(
                children.start, "spawn", _lease_and_write, w.name, backend_name(anyio_backend)
            )
            with anyio.fail_after(TIMEOUT):
                await w.wait_readers()
            await w.put(sent)
            codes = await anyio.to_thread.run_sync(children.join, TIMEOUT)
            assert codes == [-signal.SIGSEGV]
            got = await other.get()
            assert torch.equal(got, sent)  # the write never reached the ring
            # The dead reader still holds the ring's room: after three more, a put must wait
            # for it, and learns it died instead of hanging.
            await w.put_many([1, 2, 3])
            assert [await other.get() for _ in range(3)] == [1, 2, 3]
            assert w.statistics().messages_in_ring == 4
            with anyio.fail_after(10), pytest.raises(aioshmq.PeerDied) as info:
                await w.put(4)
            assert (info.value.index, info.value.pid, info.value.role) == (0, proc.pid, "reader")
            w.drop_reader(0)
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(w.put_many, [sent] * 10)  # more than the ring holds
                    for _ in range(10):
                        async with other.lease() as leased:
                            assert torch.equal(leased, sent)
                            del leased
            assert w.statistics().messages_in_ring == 0


async def test_a_leased_numpy_array_refuses_writes_and_the_other_reader_gets_the_original() -> None:
    sent = np.arange(1 << 14, dtype=np.float64)
    with aioshmq.create(capacity=1 << 20, readers=2) as w:
        with aioshmq.connect(w.name, 0) as r0, aioshmq.connect(w.name, 1) as r1:
            await w.put({"a": sent, "t": torch.ones(4)})
            async with r0.lease() as got:
                arr = got["a"]
                assert not arr.flags.writeable
                with pytest.raises(ValueError, match="read-only"):
                    arr[0] = -1
                with pytest.raises(ValueError):
                    arr.setflags(write=True)
                with pytest.raises(ValueError):
                    np.copyto(arr, 0.0)
                del got, arr
            other = await r1.get()
            assert np.array_equal(other["a"], sent) and torch.equal(other["t"], torch.ones(4))


# -- rpc --------------------------------------------------------------------------------------


class TensorTarget:
    """What the rpc worker serves: methods taking and returning tensors."""

    def scaled(self, t: Any, k: float) -> Any:
        return t * k

    def bump(self, t: Any) -> Any:
        return t.add_(1)  # the argument is the worker's own, writable

    def layout(self, t: Any) -> tuple[str, tuple[int, ...], tuple[int, ...], bool]:
        return str(t.dtype), tuple(t.shape), tuple(t.stride()), t.requires_grad


def _serve(handle: rpc.RpcHandle, backend: str) -> None:
    run_backend(backend, lambda: rpc.serve(handle, 0, TensorTarget()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", BACKENDS_ASYNCIO_FIRST)
async def test_rpc_with_tensor_arguments_and_results(
    anyio_backend: object, children: Children
) -> None:
    """start method: spawn.  A tensor argument and a tensor result, out of band both ways."""
    async with rpc.Client(1) as client:
        await anyio.to_thread.run_sync(
            children.start, "spawn", _serve, client.handle, backend_name(anyio_backend)
        )
        with anyio.fail_after(TIMEOUT):
            await client.wait_workers()
            big = torch.randn(512, 512)  # 1 MiB, out of band both ways
            (doubled,) = await client.call("scaled", big, 2.0)
            assert type(doubled) is torch.Tensor and torch.equal(doubled, big * 2)
            sent = torch.arange(12, dtype=torch.int32).reshape(3, 4)
            (bumped,) = await client.call("bump", sent)
            assert torch.equal(bumped, sent + 1)
            assert torch.equal(sent, torch.arange(12, dtype=torch.int32).reshape(3, 4))
            transposed = torch.randn(4, 6, dtype=torch.float64, requires_grad=True).t()
            assert await client.call("layout", transposed) == [
                ("torch.float64", (6, 4), (1, 6), True)
            ]
            bumped.fill_(0)  # the result is the caller's own memory
    assert await anyio.to_thread.run_sync(children.join, TIMEOUT) == [0]
