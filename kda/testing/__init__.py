"""Property-based tests of any KDA kernel against kda's exact recurrence (``pip install kda[testing]``).

>>> import kda.testing as kt                                              # doctest: +SKIP
>>> kt.check_kernel(my_chunk_kda, convention="fla",                       # doctest: +SKIP
...                 problems=kt.problems(dtypes=("float32",), packed=(False,)))

- :func:`problems`: a hypothesis strategy of :class:`Problem` (float64 masters, the dtype to cast
  to, the options, the chunk size); every argument narrows the space.
- :func:`reference`: the exact float64 output, final state, chunk-boundary states and every
  gradient (``A_log``, ``dt_bias`` included) from kda's recurrence.
- :func:`error_scales`: what a correct kernel of the problem's dtype can meet, per tensor: for float32
  :data:`YARDSTICK_MARGIN` times kda's own float32 error on the same rounded inputs
  (:func:`yardstick`) or a floor tied to the inputs' magnitudes, whichever is larger.
- :func:`check_kernel`: unmodified inputs, finiteness, causality, accuracy and determinism on drawn
  problems. An error up to its scale is accurate, up to :data:`IMPRECISE_BAND` times it imprecise
  (reported in the summary; a failure with ``strict=True``), beyond it wrong; a kernel's
  ``NotImplementedError`` rejects the draw (counted, with the options to narrow). A failure prints
  the shrunk problem as a runnable reproducer.
- :func:`assert_close`: the dtype-relative comparison kda's own tests use, with :data:`TOLERANCES`.
- ``python -m kda.testing MODULE:FUNCTION --convention fla [--strict] [every problems() argument]``:
  the same from a shell. ``docs/testing.md`` is the guide.

Importing this module imports hypothesis (through :func:`problems`, lazily) and NumPy; torch only
when the ``"fla"`` convention is used.
"""

from ._check import (
    CONVENTIONS,
    Imprecise,
    KernelCheckFailed,
    Summary,
    check_kernel,
    check_problem,
    default_problems,
    reproducer,
)
from ._compare import TOLERANCES, Mismatch, assert_close, compare, to_numpy, tolerance
from ._draw import problems
from ._fla import load_fla_naive
from ._problems import DTYPES, LOG_REGIMES, REGIMES, SIZE_CLASSES, Problem, gates, round_to
from ._reference import GRADIENTS, Reference, log_decay, reference
from ._scale import IMPRECISE_BAND, YARDSTICK_MARGIN, error_scales, yardstick

__all__ = [
    "CONVENTIONS",
    "DTYPES",
    "GRADIENTS",
    "IMPRECISE_BAND",
    "LOG_REGIMES",
    "REGIMES",
    "SIZE_CLASSES",
    "TOLERANCES",
    "YARDSTICK_MARGIN",
    "Imprecise",
    "KernelCheckFailed",
    "Mismatch",
    "Problem",
    "Reference",
    "Summary",
    "assert_close",
    "check_kernel",
    "check_problem",
    "compare",
    "default_problems",
    "error_scales",
    "gates",
    "load_fla_naive",
    "log_decay",
    "problems",
    "reference",
    "reproducer",
    "round_to",
    "to_numpy",
    "tolerance",
    "yardstick",
]
