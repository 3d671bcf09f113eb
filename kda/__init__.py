"""Kimi Delta Attention (the gated delta rule with per-channel decay), forward and backward,
for any array library that follows the Python array API standard.

>>> import numpy as np, kda
>>> out = kda.chunk_kda(q, k, v, g, beta, save_boundaries=True)   # doctest: +SKIP
"""

from ._api import (
    KdaGradients,
    KdaOutput,
    chunk_kda,
    chunk_kda_backward,
    recurrent_kda,
    recurrent_kda_backward,
)
from ._backends import BACKENDS
from ._decode import decode_kda
from ._errors import InvalidInputError, InvalidTypeError, KdaError, KdaWarning
from ._plan import prepare_chunk_kda, prepare_chunk_kda_backward
from ._transition import KdaTransition, chunk_kda_transition, chunk_kda_transition_backward

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
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
    "recurrent_kda",
    "recurrent_kda_backward",
]
