"""PyTorch tensors out of band: the reducer of CPU tensors, and their rebuilding on buffers.

torch's own pickling copies a tensor's storage into the pickle (through ``torch.save``); here
its bytes go into the ring beside the pickle, and a reader's tensor is built on them: on a
copy it owns after ``get()``, on the ring itself (read-only) inside a lease.  Imported only
once a tensor is seen: the writer's serializer looks for ``torch`` in ``sys.modules``, and a
reader imports this module when a message names ``rebuild``.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

__all__ = ["placeholder", "rebuild", "reduce_tensor", "tensor_view"]

_DTYPES: dict[str, torch.dtype] = {}
_NAMES: dict[torch.dtype, str] = {}
_quiet = False  # torch has given its once-a-process warning about read-only buffers


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        found = getattr(torch, name, None)
        if not isinstance(found, torch.dtype):
            raise pickle.UnpicklingError(f"torch has no dtype named {name!r}")
        dtype = _DTYPES[name] = found
    return dtype


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dimensions of ``t`` from outermost to innermost in memory if its elements fill
    one span without gaps or overlaps (contiguous, or a permutation of it); else None."""
    strides: tuple[int, ...] = tuple(t.stride())
    sizes: tuple[int, ...] = tuple(t.shape)
    dims = sorted(range(len(sizes)), key=lambda d: (-strides[d], -sizes[d]))
    expected = 1
    for d in reversed(dims):
        size = sizes[d]
        if size != 1 and strides[d] != expected:
            return None
        expected *= size
    return dims


def not_on_cpu(t: torch.Tensor) -> TypeError:
    """The error for a tensor whose memory is not this process's (CUDA and the others)."""
    device = t.device
    if device.type == "meta":
        return TypeError(
            "a tensor on the 'meta' device has no data to send: make it on the CPU "
            "(torch.empty(..., device='cpu')) or send its shape and dtype instead"
        )
    return TypeError(
        f"a tensor on {device} cannot travel through shared memory: copy it to the CPU "
        "first (tensor.cpu(), or tensor.to('cpu', non_blocking=True) and a synchronize), "
        "and back to the device on the other side; device memory is shared between "
        "processes with torch.multiprocessing (CUDA IPC), not through a ring"
    )


def reduce_tensor(t: torch.Tensor) -> tuple[Any, ...]:
    """Reduce a plain ``torch.Tensor`` so that its bytes travel out of band."""
    if t.device.type != "cpu":
        raise not_on_cpu(t)
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        # torch's own pickling: sparse, quantized, nested (their inner tensors come back here)
        fn, args, *rest = t.__reduce_ex__(5)  # type: ignore[no-untyped-call]
        return (rebuild_checked, (fn, args), *rest)
    requires_grad = t.requires_grad
    data = t.detach() if requires_grad else t
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    name = _NAMES.get(data.dtype)
    if name is None:
        name = _NAMES[data.dtype] = str(data.dtype).removeprefix("torch.")
    order: list[int] | None = None  # C order, the common case
    if not data.is_contiguous():
        order = _dense_order(data)
        if order is None:  # gaps or overlaps (a slice, an expand): made contiguous, once
            data = data.contiguous()
        elif order == sorted(order):
            order = None
    shape = tuple(data.shape)
    strides = data.stride()
    if data.numel() == 0:
        return rebuild, (None, name, shape, strides, None, requires_grad)
    line = (data if order is None else data.permute(order)).reshape(-1)
    if line.stride(0) != 1:  # one element whose stride is not 1: dense, but not to view()
        line = line.as_strided((line.numel(),), (1,))
    raw: Any = line.view(torch.uint8).numpy()
    return rebuild, (pickle.PickleBuffer(raw), name, shape, strides, order, requires_grad)


def rebuild_checked(fn: Any, args: tuple[Any, ...]) -> Any:
    """``fn(*args)``, torch's own rebuilding, then what ``torch.load`` does after it: check the
    sparse tensors it rebuilt (which torch keeps in a list, for ever, until then)."""
    t = fn(*args)
    if torch._utils._sparse_tensors_to_validate:
        torch._utils._validate_loaded_sparse_tensors()  # type: ignore[no-untyped-call]
    return t


def _empty(shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.empty_strided(shape, strides, dtype=dtype)
    except RuntimeError:  # a quantized dtype held by a plain tensor: from bytes, as it was made
        if any(n == 0 for n in shape):
            return torch.empty(0, dtype=torch.uint8).view(dtype).reshape(shape)
        raise


def tensor_view(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A C-contiguous tensor of ``shape`` on ``buffer``'s memory, without a copy."""
    global _quiet
    view = memoryview(buffer)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly and not _quiet:
        # torch warns, once a process, that it cannot mark the tensor read-only: the memory
        # itself is (readers map the ring's data read-only), so the warning would only
        # alarm, and fail a program that turns warnings into errors.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            raw = torch.frombuffer(view, dtype=torch.uint8)
        _quiet = True
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
    t = raw.view(dtype)
    return t if len(shape) == 1 else t.view(shape)


def rebuild(
    buffer: Any,
    name: str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    order: list[int] | None,
    requires_grad: bool,
) -> torch.Tensor:
    """The tensor ``reduce_tensor`` described, on ``buffer``'s memory."""
    dtype = _dtype(name)
    count = 1
    for n in shape:
        count *= n
    if buffer is None:
        if count:
            raise pickle.UnpicklingError(f"tensor of shape {shape} without its bytes")
        t = _empty(shape, strides, dtype)
    else:
        if order is None:
            outer = shape
        elif len(order) != len(shape) or sorted(order) != list(range(len(shape))):
            raise pickle.UnpicklingError(f"tensor dimension order {order!r} for shape {shape}")
        else:
            outer = tuple(shape[d] for d in order)
        nbytes = memoryview(buffer).nbytes
        if nbytes != count * dtype.itemsize:
            raise pickle.UnpicklingError(
                f"tensor of shape {shape} and dtype {name} needs {count * dtype.itemsize} "
                f"bytes, the message carries {nbytes}"
            )
        t = tensor_view(buffer, dtype, outer)
        if order is not None:
            inverse = [0] * len(order)
            for i, d in enumerate(order):
                inverse[d] = i
            t = t.permute(inverse)
    if requires_grad:
        t.requires_grad_(True)
    return t


def placeholder(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor whose pickle, buffers aside, is what a reserved tensor of ``dtype`` and
    ``shape`` is sent as (its memory is never touched)."""
    return torch.empty(shape, dtype=dtype)
