"""What :func:`~kda.testing.check_kernel` reports: the failure it raises, and the summary of a run."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._problems import Problem
from ._scale import verdict

__all__ = ["Imprecise", "KernelCheckFailed", "Summary", "record"]


class KernelCheckFailed(AssertionError):
    """A check failed. Attributes: ``check`` (one of ``call``, ``inputs unmodified``, ``finite``,
    ``accuracy``, ``deterministic``, ``causal``), ``problem`` (the shrunk problem), ``examples``
    (examples run up to the first failure), ``seconds``, ``reproducer`` (Python source)."""

    def __init__(self, message: str, *, check: str, problem: Problem | None = None) -> None:
        super().__init__(message)
        self.check = check
        self.problem = problem
        self.examples = 0
        self.seconds = 0.0
        self.reproducer = ""


@dataclass
class Imprecise:
    """A tensor judged imprecise: in how many ``examples``, the ``worst`` ratio of error to its scale,
    that example's ``detail`` (the element, both values, the scale) and ``problem``."""

    examples: int
    worst: float
    detail: str
    problem: Problem


# problems() narrowing for each feature tag a rejected draw had
_NARROW = {
    "scale": "scale=('default',)",
    "packed": "packed=(False,)",
    "gva": "groups=(1,)",
    "qk_l2norm": "qk_l2norm=(False,)",
    "initial_state": "initial_state=(False,)",
}
_NARROW_PREFIX = {
    "gate": "gates",
    "beta": "beta_activations",
    "regime": "regimes",
    "dtype": "dtypes",
    "layout": "layouts",
    "chunk": "chunk_sizes",
    "size": "T",
}


@dataclass
class Summary:
    """What :func:`check_kernel` ran.

    Attributes
    ----------
    examples : int
        Examples checked (rejected draws not counted).
    worst : dict
        The worst ratio of error to error scale per tensor (``<= 1``: accurate).
    imprecise : dict
        Per tensor judged imprecise in some example: :class:`Imprecise`.
    rejected : int
        Draws the kernel rejected by raising ``NotImplementedError``.
    rejected_features, features : dict
        Feature tags (:attr:`Problem.features`) of the rejected draws and of the examples checked.
    checks : tuple of str
    seconds : float
    """

    examples: int = 0
    worst: dict[str, float] = field(default_factory=dict)
    imprecise: dict[str, Imprecise] = field(default_factory=dict)
    rejected: int = 0
    rejected_features: dict[str, int] = field(default_factory=dict)
    checks: tuple[str, ...] = ()
    features: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)

    def narrowing(self) -> list[str]:
        """The ``problems(...)`` arguments that would avoid most rejected draws: features that were
        in at least a quarter of the rejected draws and were rejected at least 9 times in 10."""
        out = []
        for tag, n in sorted(self.rejected_features.items(), key=lambda x: -x[1]):
            rate = n / (n + self.features.get(tag, 0))
            if rate < 0.9 or n < self.rejected / 4:
                continue
            if tag in _NARROW:
                hint = _NARROW[tag]
            elif tag.split("=")[0] in _NARROW_PREFIX:
                key, _, value = tag.partition("=")
                hint = f"{_NARROW_PREFIX[key]} without {value}"
            else:
                continue
            out.append(f"{hint} ({n} of {n + self.features.get(tag, 0)} draws with {tag!r} rejected)")
        return out

    def __str__(self) -> str:
        rej = ""
        if self.rejected:
            top = sorted(self.reasons.items(), key=lambda x: -x[1])[:3]
            why = "; ".join(f"{r!r} x {c}" for r, c in top)
            rej = f" ({self.rejected} draws rejected with NotImplementedError: {why})"
        lines = [f"{self.examples} examples passed in {self.seconds:.1f} s{rej}"]
        lines[0] += f"; checks: {', '.join(self.checks)}"
        if self.rejected > self.examples:
            hints = self.narrowing()
            lines.append(
                "most draws were rejected: narrow problems(...) by "
                + ("; ".join(hints) if hints else "the options the kernel lacks")
            )
        lines.append("worst error / error scale per tensor (<= 1: accurate):")
        for n, r in sorted(self.worst.items()):
            line = f"  {n:<16} {r:.3g}"
            if n in self.imprecise:
                im = self.imprecise[n]
                line += f"  IMPRECISE in {im.examples} examples; worst: {im.detail}\n    in {im.problem!r}"
            lines.append(line)
        return "\n".join(lines)


def record(summary: Summary, p: Problem, ratios: dict[str, float], details: dict[str, str]) -> None:
    """Count one passed example of ``p`` in ``summary``: its worst ratios, imprecise tensors, features."""
    summary.examples += 1
    for n, r in ratios.items():
        summary.worst[n] = max(summary.worst.get(n, 0.0), r)
        if verdict(r, p.dtype) == "imprecise":
            im = summary.imprecise.get(n)
            if im is None:
                summary.imprecise[n] = Imprecise(1, r, details[n], p)
            else:
                im.examples += 1
                if r > im.worst:
                    im.worst, im.detail, im.problem = r, details[n], p
    for f in p.features:
        summary.features[f] = summary.features.get(f, 0) + 1
