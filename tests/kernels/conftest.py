"""Kernel tests run on CPU: Triton kernels execute in the Triton interpreter.

tests/conftest.py sets TRITON_INTERPRET=1 for the whole process before triton
is imported (Triton decorates its own standard library at import time, so the
variable cannot be switched on later). Here each kernel test additionally asks
for Triton as the default CPU backend; other packages' tests keep the
reference backend.
"""

from __future__ import annotations

import pytest

from specmask.kernels.backend import BACKEND_ENV


@pytest.fixture(autouse=True)
def triton_default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "triton")
