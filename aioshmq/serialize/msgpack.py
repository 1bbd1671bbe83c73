"""The msgspec serializer: MessagePack, typed decoding, arrays and tensors out of band.

msgpack has no place for a buffer outside its stream, so an array travels as a small
extension record (its dtype, shape and the index of its buffer) while its bytes go into the
ring beside the stream, as pickle's out-of-band buffers do.  A reader rebuilds the array on
those bytes: a copy it owns after ``get()``, the ring itself (read-only) inside a lease.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .base import Buffer, Serializer, unserializable

_ARRAY = 1  # extension code of a numpy array
_TENSOR = 2  # extension code of a torch tensor


class MsgpackSerializer(Serializer):
    """MessagePack through msgspec (``pip install 'aioshmq[msgspec]'``).

    ``type`` is what readers decode into (``msgspec.Struct`` classes, dataclasses, ``list[int]``
    and the rest of msgspec's types; ``Any`` by default); pass the same serializer to
    ``connect`` to decode into it, or readers get plain dicts and lists.  ``enc_hook`` and
    ``dec_hook`` extend the types it knows, as in msgspec.  numpy arrays (of numeric and
    fixed-size dtypes) and CPU torch tensors travel out of band; ``bytes`` travel in the
    stream, as msgpack's ``bin``.
    """

    name = "msgpack"

    def __init__(
        self,
        type: Any = Any,
        *,
        enc_hook: Callable[[Any], Any] | None = None,
        dec_hook: Callable[[type, Any], Any] | None = None,
    ) -> None:
        try:
            import msgspec
        except ImportError:
            raise ImportError(
                "serializer='msgpack' needs the msgspec package: pip install 'aioshmq[msgspec]'"
            ) from None
        self._msgspec = msgspec
        self._ext = msgspec.msgpack.Ext
        self._user_enc = enc_hook
        self._local = threading.local()  # the buffers of the call under way in this thread
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._header = msgspec.msgpack.Encoder()
        self._read_header = msgspec.msgpack.Decoder(list[Any])
        self._decoder = msgspec.msgpack.Decoder(type, dec_hook=dec_hook, ext_hook=self._ext_hook)
        self._decode = self._decoder.decode

    # -- writing ---------------------------------------------------------------------------

    def dumps(self, obj: Any) -> tuple[Buffer, list[memoryview]]:
        local = self._local
        found: list[memoryview] = []
        outer = getattr(local, "sink", None)  # an enc_hook that serializes on this thread
        local.sink = found
        try:
            main = self._encoder.encode(obj)
        except MemoryError:
            raise
        except Exception as exc:
            raise unserializable(obj, exc, self.name) from exc
        finally:
            local.sink = outer
        return main, found

    def _enc_hook(self, obj: Any) -> Any:
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            return self._array(np, obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if self._user_enc is not None:
            return self._user_enc(obj)
        raise NotImplementedError(f"msgpack cannot encode {type(obj).__qualname__} objects")

    def _buffer(self, data: Any) -> int:
        found: list[memoryview] = self._local.sink
        found.append(memoryview(data))
        return len(found) - 1

    def _array(self, np: Any, arr: Any) -> Any:
        if arr.dtype.hasobject:
            raise TypeError(f"an array of dtype {arr.dtype} holds Python objects, not bytes")
        descr = np.lib.format.dtype_to_descr(arr.dtype)
        data = np.ascontiguousarray(arr)  # no copy if it already is
        index = self._buffer(data.reshape(-1).view(np.uint8)) if data.nbytes else -1
        return self._ext(_ARRAY, self._header.encode([index, descr, list(arr.shape)]))

    def _tensor(self, t: Any) -> Any:
        from . import tensors as _torch

        rebuild, args = _torch.reduce_tensor(t)
        if rebuild is not _torch.rebuild:
            raise TypeError(
                f"serializer='msgpack' sends strided CPU tensors; this one is "
                f"{t.layout} (quantized={t.is_quantized}): use serializer='pickle'"
            )
        buffer, name, shape, strides, order, requires_grad = args
        index = -1 if buffer is None else self._buffer(buffer.raw())
        header = [index, name, list(shape), list(strides), order, requires_grad]
        return self._ext(_TENSOR, self._header.encode(header))

    # -- reading ---------------------------------------------------------------------------

    def loads(self, main: memoryview, buffers: Sequence[Buffer]) -> Any:
        if not buffers:
            return self._decode(main)
        local = self._local
        outer = getattr(local, "buffers", ())
        local.buffers = buffers
        try:
            return self._decode(main)
        finally:
            local.buffers = outer

    def loads_plain(self, main: memoryview) -> Any:
        return self._decode(main)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (_ARRAY, _TENSOR):
            raise ValueError(f"msgpack extension type {code} is not one aioshmq writes")
        try:
            header = self._read_header.decode(data)
            index = header[0]
        except (self._msgspec.DecodeError, IndexError):
            raise ValueError("a corrupt array header in a msgpack message") from None
        buffers: Sequence[Buffer] = getattr(self._local, "buffers", ())
        if not isinstance(index, int) or not -1 <= index < len(buffers):
            raise ValueError(
                f"a msgpack message names buffer {index!r}, and it carries {len(buffers)}"
            )
        buffer = None if index < 0 else buffers[index]
        if code == _ARRAY:
            return _load_array(buffer, header)
        from . import tensors as _torch

        try:
            _, name, shape, strides, order, requires_grad = header
            return _torch.rebuild(
                buffer, name, tuple(shape), tuple(strides), order, bool(requires_grad)
            )
        except (TypeError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:
            raise ValueError(f"a corrupt tensor header in a msgpack message: {exc}") from None


def _load_array(buffer: Buffer | None, header: list[Any]) -> Any:
    import numpy as np

    try:
        _, descr, shape = header
        dtype = np.lib.format.descr_to_dtype(descr)
        if buffer is None:
            if any(n == 0 for n in shape):
                return np.empty(shape, dtype)
            raise ValueError(f"shape {shape} has elements and the message no buffer")
        return np.frombuffer(buffer, dtype).reshape(shape)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a corrupt array header in a msgpack message: {exc}") from None
