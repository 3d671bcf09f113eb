"""The ``torch.ops.kda`` op schemas are public: pinned, so that no change alters one silently.

``torch_op_schemas.txt`` beside this file was generated once from the tree before the interior's
records were introduced: every ``kda::`` schema that ``import kda.torch`` registers, one a line,
``str(schema)`` of ``torch._C._jit_get_all_schemas()``, sorted. The ops' schemas are generated
from records (:mod:`kda._torch.ops`), so a field added to, removed from, reordered in or retyped
in ``kda._entry.call.Inputs`` or ``kda._entry.fla.OpOptions`` changes them and fails this test. A
change to an op's schema is a change of kda's public API: make it on purpose, in the file too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import kda.torch  # noqa: E402, F401  (registers the ops)

PINNED = Path(__file__).with_name("torch_op_schemas.txt")


def test_op_schemas_are_pinned():
    registered = sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("kda::"))
    assert registered == PINNED.read_text().splitlines()
