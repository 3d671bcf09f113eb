"""Version strings of the libraries kda's adapters are written against (vLLM, transformers): their
release numbers, and whether a version is in a supported range. No dependency (not ``packaging``)."""

from __future__ import annotations

import re

__all__ = ["release", "within"]

_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """The release numbers a version string starts with, trailing zeros dropped (``"0.32"`` and
    ``"0.32.0"`` are one release): ``"0.32.0+cpu"`` -> ``(0, 32)``, ``"5.24.1.dev0"`` ->
    ``(5, 24, 1)``; ``()`` for a string that starts with none (``"dev"``). Pre-release and local
    parts are ignored: ``"0.33.0rc1"`` counts as 0.33."""
    match = _RELEASE.match(version)
    if match is None:
        return ()
    numbers = [int(p) for p in match.group(1).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def within(version: str, supported: tuple[str, str]) -> bool:
    """Whether ``version`` is in ``supported``: ``(first, end)``, first included, end excluded, by
    :func:`release`; a version without release numbers is in no range."""
    first, end = supported
    numbers = release(version)
    return bool(numbers) and release(first) <= numbers < release(end)
