"""Kernel tests run on CPU: Triton kernels execute in the Triton interpreter.

TRITON_INTERPRET=1 is set per test (not process-wide), so other packages' tests
in the same pytest run keep the default CPU backend (the reference). Triton
reads the variable when a kernel module is first imported, which in
`kernels/` only happens inside a dispatcher call, i.e. inside a test.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
