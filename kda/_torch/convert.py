"""Tensors to kda's arrays and back: NumPy views of CPU tensors, CuPy views of CUDA tensors (on
PyTorch's current stream), state pools as they are, and results back as tensors that share no
input's memory."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .._entry.fla import FlaCall
from .._errors import InvalidTypeError
from .._options.arguments import c_contiguous
from .._options.gates import PARAMETERS

HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype kda computes inputs of ``dtype`` in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_NO_STREAM = contextlib.nullcontext()  # reusable: entering it does nothing


def on_stream(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A CUDA tensor: make CuPy's current stream PyTorch's current stream on ``t``'s device; a
    CPU tensor: nothing."""
    return _cuda_stream(t.device) if t.is_cuda else _NO_STREAM


@contextlib.contextmanager
def _cuda_stream(device: torch.device) -> Iterator[None]:
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        yield


# dtypes a CPU tensor's own NumPy view serves as is (the states and steps; the slot indices)
VIEWED = (torch.float32, torch.float64, torch.int32, torch.int64)


def array(t: torch.Tensor | None) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) view of ``t``; half-precision floats as float32 first."""
    if t is None:
        return None
    if t.dtype in VIEWED and t.is_cpu:
        try:
            return t.numpy()  # the common case, a view; refused if t requires a gradient
        except RuntimeError:
            pass
    t = t.detach()
    if t.dtype in HALF:
        t = t.float()
    if t.device.type == "cpu":
        return t.resolve_conj().resolve_neg().numpy()
    if t.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(t)
    msg = f"kda.torch runs on CPU and CUDA tensors; got a tensor on {t.device}"
    raise InvalidTypeError(msg)


# id of a bfloat16 pool tensor -> (a weak reference to it, (data_ptr, shape, strides), its
# ml_dtypes view): the view made once per pool tensor, dropped with the tensor
BF16_VIEWS: dict[int, tuple[Any, tuple, Any]] = {}


def _forget_view(key: int, _ref: Any) -> None:
    BF16_VIEWS.pop(key, None)


def pool_array(t: torch.Tensor) -> Any:
    """A view of the state pool ``t`` (updated in place: never a copy), float16 and bfloat16 as
    they are (``ml_dtypes.bfloat16`` on the host)."""
    if t.is_cpu and t.dtype != torch.bfloat16:
        return t.numpy()
    if t.is_cpu:
        try:
            import ml_dtypes
        except ImportError as err:
            msg = (
                "a bfloat16 state pool on the CPU needs ml_dtypes (pip install ml_dtypes): it is read as such"
            )
            raise InvalidTypeError(msg) from err
        key = (t.data_ptr(), t.shape, t.stride())
        seen = BF16_VIEWS.get(id(t))
        if seen is None or seen[0]() is not t or seen[1] != key:  # torch's view(dtype): ~6 us
            ref = weakref.ref(t, functools.partial(_forget_view, id(t)))
            seen = BF16_VIEWS[id(t)] = (ref, key, t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        return seen[2]
    if t.device.type == "cuda":
        if t.dtype == torch.bfloat16:
            msg = "a bfloat16 state pool on CUDA is not supported (CuPy has no bfloat16); use float16"
            raise InvalidTypeError(msg)
        import cupy

        return cupy.from_dlpack(t)
    msg = f"kda.torch runs on CPU and CUDA tensors; got a tensor on {t.device}"
    raise InvalidTypeError(msg)


def tensor(a: Any, dtype: torch.dtype, inputs: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """``a`` as a contiguous tensor of ``dtype`` that shares no memory with ``inputs``."""
    if isinstance(a, np.ndarray):  # NumPy's copy: torch's parallel one costs ms on small arrays
        t = torch.from_numpy(a if a.flags.writeable and c_contiguous(a) else np.array(a, order="C"))
    else:
        t = torch.from_dlpack(a)
    t = t.to(dtype).contiguous()
    owners = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    return t.clone() if t.untyped_storage().data_ptr() in owners else t


def fresh(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """``a``, a new array of this call (it shares no input's memory), as a contiguous tensor of
    ``dtype``: no copy where it already is one."""
    contiguous = c_contiguous(a)  # a NumPy array's flags: a quicker question than the tensor's
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return t if t.dtype == dtype and contiguous else t.to(dtype).contiguous()


def offsets(cu_seqlens: torch.Tensor | None) -> tuple[int, ...] | None:
    """``cu_seqlens`` as host offsets (None stays None)."""
    return None if cu_seqlens is None else tuple(int(n) for n in cu_seqlens.tolist())


def gate_params(call: FlaCall, A_log: Any, dt_bias: Any, cd: torch.dtype) -> tuple[Any, Any]:
    """``A_log`` (``HV`` elements, as ``[HV]``) and ``dt_bias`` (``HV * K`` elements, as
    ``[HV, K]``) in the compute dtype ``cd``; reshapes, so autograd returns their gradients in the
    shapes given."""
    if A_log is None and dt_bias is None:
        return None, None  # (their element counts: checked by kda._entry.host.route)
    HV, K = call.dt_bias_shape
    given = zip(PARAMETERS, (A_log, dt_bias), strict=True)
    A_log, dt_bias = (None if x is None else x.reshape(p.shape(HV, K)).to(cd) for p, x in given)
    return A_log, dt_bias
