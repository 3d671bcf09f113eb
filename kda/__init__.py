"""Kimi Delta Attention (the gated delta rule with per-channel decay), forward and backward,
for any array library that follows the Python array API standard.

>>> import numpy as np, kda
>>> out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True)   # doctest: +SKIP
"""

from ._backend import BACKENDS
from ._entry.api import (
    KdaGradients,
    KdaOutput,
    chunk_kda,
    chunk_kda_backward,
    recurrent_kda,
    recurrent_kda_backward,
)
from ._entry.decode import decode_kda
from ._entry.decode_plan import DecodePlan, prepare_decode_kda
from ._entry.plan import prepare_chunk_kda, prepare_chunk_kda_backward
from ._entry.transition import KdaTransition, chunk_kda_transition, chunk_kda_transition_backward
from ._errors import InvalidInputError, InvalidTypeError, KdaError, KdaWarning

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DecodePlan",
    "InvalidInputError",
    "InvalidTypeError",
    "KdaError",
    "KdaGradients",
    "KdaOutput",
    "KdaTransition",
    "KdaWarning",
    "chunk_kda",
    "chunk_kda_backward",
    "chunk_kda_transition",
    "chunk_kda_transition_backward",
    "decode_kda",
    "prepare_chunk_kda",
    "prepare_chunk_kda_backward",
    "prepare_decode_kda",
    "recurrent_kda",
    "recurrent_kda_backward",
]
