"""pickle and cloudpickle, protocol 5: large buffers out of band, reducers of a ring's own."""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .base import Buffer, Serializer, unserializable

_ARRAY_CACHE_SIZE = 64
_modules = sys.modules

Reducer = Callable[[Any], "str | tuple[Any, ...]"]

# Exact instances of these pickle writes itself: it asks neither a dispatch table nor even
# reducer_override about them (the pickle module's documentation says so).
_OWN_TYPES = frozenset(
    {type(None), bool, int, float, str, bytes, bytearray, tuple, list, dict, set, frozenset}
)


class _Table(dict[type, Reducer]):
    """A pickler's dispatch table: its own reducers first, then ``base`` (copyreg's, or
    cloudpickle's), looked up as they are when an object is pickled."""

    def __init__(self, base: Mapping[type, Reducer]) -> None:
        super().__init__()
        self._base = base

    def __missing__(self, key: type) -> Reducer:
        return self._base[key]


class _Reducing:
    """``pickle.dumps(obj, protocol=5, buffer_callback=...)`` with a dispatch table, on one
    Pickler reused from call to call (as fast as ``pickle.dumps`` itself, measured)."""

    # Plain values (exact None, bool, int, float, str, bytes, tuple, list, dict) come out as
    # pickle.dumps writes them: _pickle consults no dispatch table or reducer_override for
    # those, so the compiled writer may pickle them itself (aioshmq/ring/plainpickle.c).
    plain_as_pickle = True

    def __init__(self, pickler: type[pickle.Pickler], table: _Table) -> None:
        # The C Pickler reads ``dispatch_table`` once, at init, from its class or instance;
        # cloudpickle's class attribute shadows the instance slot, so the table goes on a
        # subclass, where both find it.
        self._cls: type[pickle.Pickler] = type("_Pickler", (pickler,), {"dispatch_table": table})
        self._file = io.BytesIO()
        self._sink: Callable[[pickle.PickleBuffer], Any] | None = None
        self._pickler = self._make(self._file, self._relay)
        self._guard = threading.Lock()  # the reused Pickler serves one call at a time

    def _make(self, file: io.BytesIO, callback: Callable[..., Any] | None) -> pickle.Pickler:
        return self._cls(file, 5, buffer_callback=callback)

    def _relay(self, buffer: pickle.PickleBuffer) -> Any:
        sink = self._sink
        return True if sink is None else sink(buffer)  # no callback: in band, as pickle does

    def __call__(
        self,
        obj: Any,
        protocol: int = 5,
        buffer_callback: Callable[[pickle.PickleBuffer], Any] | None = None,
    ) -> bytes:
        if not self._guard.acquire(False):  # another thread, or a reducer that puts
            file = io.BytesIO()
            self._make(file, buffer_callback).dump(obj)
            return file.getvalue()
        try:
            self._sink = buffer_callback
            file = self._file
            file.seek(0)
            file.truncate()
            pickler = self._pickler
            pickler.clear_memo()
            try:
                pickler.dump(obj)
            except BaseException:
                self._pickler = self._make(file, self._relay)  # whatever state it was left in
                raise
            return file.getvalue()
        finally:
            self._sink = None
            self._guard.release()


class PickleSerializer(Serializer):
    """pickle, protocol 5: out-of-band buffers (numpy arrays, ``PickleBuffer``, CPU torch
    tensors) go into the ring beside the pickle, not through it.

    ``reducers`` maps types to reducer functions, as in ``copyreg.pickle`` but for this
    serializer alone: a reducer returns what ``__reduce__`` would, and any
    ``pickle.PickleBuffer`` in its arguments travels out of band.  Readers need nothing
    registered: what a reducer names is found by import, as pickle always does.
    """

    __slots__ = ("_current", "_torch")

    name = "pickle"
    _pickler_class: type[pickle.Pickler] = pickle.Pickler

    def __init__(self, reducers: Mapping[type, Reducer] | None = None) -> None:
        self._dumps = pickle.dumps
        # Pickling a numpy array's dtype costs ~10 us here, more than copying 256 KiB.  With
        # its data out of band, a plain array's pickle depends only on its dtype and shape,
        # so the stream pickle made for the first such array is reused for the next ones.
        self._arrays: dict[tuple[Any, ...], Buffer] = {}
        base = getattr(self._pickler_class, "dispatch_table", None)  # cloudpickle's has one
        self._table = _Table(base if isinstance(base, Mapping) else copyreg.dispatch_table)
        self._reducing: _Reducing | None = None
        self._current: Callable[..., Any] = self._dumps  # what ``pickler`` gives now
        self._torch = False  # torch's reducer is in the table
        for cls, reducer in (reducers or {}).items():
            self.register(cls, reducer)

    def register(self, cls: type, reducer: Reducer) -> None:
        """Pickle instances of exactly ``cls`` with ``reducer`` from now on."""
        if not isinstance(cls, type):
            raise TypeError(f"reducers are registered for types, not {cls!r}")
        if not callable(reducer):
            raise TypeError(f"the reducer for {cls.__qualname__} must be callable, not {reducer!r}")
        if cls in _OWN_TYPES:
            raise TypeError(
                f"pickle writes {cls.__qualname__} values itself and asks no reducer about "
                f"them: register the reducer for a subclass of {cls.__qualname__} (or a "
                "class of your own) and send instances of that"
            )
        self._table[cls] = reducer
        if self._reducing is None:
            self._reducing = self._current = _Reducing(self._pickler_class, self._table)

    def _see_torch(self) -> None:
        import torch

        from . import tensors as _torch

        self._torch = True
        if torch.Tensor not in self._table:
            self.register(torch.Tensor, _torch.reduce_tensor)

    @property
    def pickler(self) -> Callable[..., Any]:
        """``pickle.dumps`` (or cloudpickle's, or one with this serializer's reducers),
        which a ring core may call itself."""
        if not self._torch and "torch" in _modules:
            self._see_torch()
        return self._current

    @property
    def array_pickles(self) -> dict[tuple[Any, ...], Buffer]:
        """The stream pickles of plain numpy arrays by ``(dtype, shape)``, data out of band,
        which a ring core's ``put_object`` may write arrays with itself."""
        return self._arrays

    def finish(self, obj: Any, rest: Any) -> tuple[Buffer, list[memoryview]]:
        """``dumps(obj)`` given what a ring core's ``put_object`` left: ``()`` or
        ``(main, [PickleBuffer, ...])``."""
        if not rest:
            return self.dumps(obj)
        main, found = rest
        if not found:
            return main, []
        try:
            return main, [pb.raw() for pb in found]
        except BufferError:  # non-contiguous: in-band, which pickle refuses clearly
            return self._pickle_in_band(obj), []

    def _pickle_in_band(self, obj: Any) -> Buffer:
        try:
            return self.pickler(obj, protocol=5)  # type: ignore[no-any-return]
        except MemoryError:
            raise
        except Exception as exc:
            raise unserializable(obj, exc, self.name) from exc

    def dumps(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray:
            return self._dumps_array(obj)
        return self._pickle(obj)

    def _pickle(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        found: list[pickle.PickleBuffer] = []
        try:
            main = self.pickler(obj, protocol=5, buffer_callback=found.append)
            if not found:
                return main, []
            try:
                return main, [pb.raw() for pb in found]
            except BufferError:  # non-contiguous: in-band, which pickle refuses clearly
                return self.pickler(obj, protocol=5), []
        except MemoryError:
            raise
        except Exception as exc:
            raise unserializable(obj, exc, self.name) from exc

    def _dumps_array(self, arr: Any) -> tuple[Buffer, list[memoryview]]:
        dtype = arr.dtype
        if not arr.flags.c_contiguous or dtype.isbuiltin != 1:
            return self._pickle(arr)
        main = self.array_header(dtype, arr.shape)
        if main is None:
            return self._pickle(arr)
        return main, [pickle.PickleBuffer(arr).raw()]

    def array_header(self, dtype: Any, shape: tuple[int, ...]) -> Buffer | None:
        """The pickle (its buffer aside) of a C-contiguous numpy array of ``dtype`` and
        ``shape``: the same for every such array.  None if it is not one buffer's pickle."""
        key = (dtype, shape)
        main = self._arrays.get(key)
        if main is None:
            np = sys.modules["numpy"]
            # np.empty maps pages lazily: a large one costs no memory it does not touch.
            main, buffers = self._pickle(np.empty(shape, dtype))
            if len(buffers) != 1:  # not the shape of pickle this cache knows
                return None
            if len(self._arrays) >= _ARRAY_CACHE_SIZE:
                self._arrays.clear()
            self._arrays[key] = main
        return main

    def buffer_header(self) -> Buffer:
        """The pickle (its buffer aside) of a bare out-of-band buffer, which loads as the
        buffer it is given: what a reserved message of bytes is sent as."""
        main = self._arrays.get(("buffer", ()))
        if main is None:
            main = self._arrays[("buffer", ())] = self._pickle(pickle.PickleBuffer(bytearray()))[0]
        return main

    def reserved_array(
        self, shape: tuple[int, ...], dtype: Any
    ) -> tuple[Buffer, int, Callable[[memoryview], Any]]:
        """For ``Writer.reserve_array``: the pickle of an array (tensor, if ``dtype`` is
        torch's) of ``shape`` and ``dtype`` with its data out of band, the data's size, and
        what makes the caller's array of the ring memory reserved for it."""
        nbytes = array_nbytes(shape, dtype)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(dtype, torch.dtype):
            from . import tensors as _torch

            if not self._torch:
                self._see_torch()
            key = ("torch", dtype, shape)
            main = self._arrays.get(key)
            if main is None:
                main = self._pickle(_torch.placeholder(dtype, shape))[0]
                if len(self._arrays) >= _ARRAY_CACHE_SIZE:
                    self._arrays.clear()
                self._arrays[key] = main

            def tensor(view: memoryview) -> Any:
                return _torch.tensor_view(view, dtype, shape)

            return main, nbytes, tensor
        import numpy as np  # array_nbytes found it

        dt = np.dtype(dtype)
        header = self.array_header(dt, shape)
        if header is None:
            raise TypeError(f"arrays of dtype {dt} do not pickle out of band")

        def array(view: memoryview) -> Any:
            return np.frombuffer(view, dt).reshape(shape)

        return header, nbytes, array

    def dumps_many(self, objs: list[Any]) -> tuple[Buffer, list[memoryview]]:
        """A whole batch as one pickled list: far cheaper per object than one each."""
        return self.dumps(objs)

    def loads(self, main: memoryview, buffers: Sequence[Buffer]) -> Any:
        return pickle.loads(main, buffers=buffers)

    loads_plain = staticmethod(pickle.loads)  # type: ignore[assignment]


class CloudpickleSerializer(PickleSerializer):
    name = "cloudpickle"

    def __init__(self, reducers: Mapping[type, Reducer] | None = None) -> None:
        try:
            import cloudpickle  # type: ignore[import-untyped]
        except ImportError:
            raise ImportError(
                "serializer='cloudpickle' needs the cloudpickle package: "
                "pip install 'aioshmq[cloudpickle]'"
            ) from None
        self._pickler_class = cloudpickle.Pickler
        super().__init__(reducers)
        self._dumps = cloudpickle.dumps
        if self._reducing is None:
            self._current = self._dumps


def array_nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    """The size of the data of an array (tensor, if ``dtype`` is torch's) of ``shape`` and
    ``dtype``, worked out without making one; TypeError for a dtype that has no bytes to
    reserve."""
    count = 1
    for n in shape:
        count *= n
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return count * int(dtype.itemsize)
    try:
        import numpy as np
    except ImportError:
        raise TypeError(
            f"reserve_array() makes numpy arrays (or torch tensors for a torch dtype), "
            f"and numpy is not installed: dtype {dtype!r}"
        ) from None
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"dtype {dt} holds Python objects, which have no bytes to reserve")
    return count * int(dt.itemsize)
