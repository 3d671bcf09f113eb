"""Whether the CUDA backend can run in this process (:func:`cuda_problem`), found without
compiling or launching anything: every reason it cannot (a missing extra, no driver, no GPU, no
NVVM) is a sentence the dispatch raises as :class:`~kda.InvalidInputError`, so that no exception
of numba or CuPy escapes for such a cause.
"""

from __future__ import annotations

import functools

__all__ = ["CUDA_FIX", "cuda_problem"]

CUDA_FIX = (
    "Use backend='reference' (NumPy or any array-API arrays on the CPU), or run on a machine with an "
    "NVIDIA GPU and driver; NUMBA_ENABLE_CUDASIM=1 runs the kernels on Numba's CPU simulator (slow)."
)


@functools.lru_cache(maxsize=1)
def cuda_problem() -> str | None:
    """Why the CUDA backend cannot run in this process, or None when it can (checked once).

    Covers numba-cuda not installed, no driver library, a driver that fails to start, no GPU,
    and no libNVVM (the compiler of the kernels). Under Numba's simulator only the import counts.
    """
    try:
        from numba import cuda
    except ImportError as err:
        return f"numba-cuda is not installed ({err}); install it with `pip install kda[cuda]`"
    if cuda.is_available():
        return None if _simulated() else _nvvm_problem()
    reason = cuda.cuda_error()
    detail = " ".join(str(reason).split()).rstrip(".") if reason is not None else "no CUDA GPU was found"
    return f"no usable CUDA GPU: {detail}"


def _simulated() -> bool:
    from numba import config

    return bool(getattr(config, "ENABLE_CUDASIM", False))


def _nvvm_problem() -> str | None:
    try:
        from numba.cuda.cudadrv.nvvm import NVVM

        NVVM()
    except Exception as err:  # numba's NvvmSupportError and whatever loading the library raises
        detail = " ".join(str(err).split()).rstrip(".")
        return (
            f"the CUDA compiler library libNVVM cannot be loaded ({detail}); install the CUDA toolkit's "
            "NVVM, e.g. `pip install nvidia-cuda-nvcc-cu12`"
        )
    return None
