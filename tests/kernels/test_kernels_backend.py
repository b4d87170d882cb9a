import pytest
import torch

from specmask.kernels.backend import BACKEND_ENV, Backend, resolve_backend


def test_default_cpu_is_reference(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, torch.device("cpu")) is Backend.REFERENCE


def test_default_cpu_is_triton_when_asked_and_interpreted():
    # The kernels conftest sets SPECMASK_KERNEL_BACKEND=triton; tests/conftest.py TRITON_INTERPRET=1.
    assert resolve_backend(None, torch.device("cpu")) is Backend.TRITON


def test_default_cpu_triton_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend(None, torch.device("cpu"))


def test_default_cuda_is_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend(None, torch.device("cuda")) is Backend.TRITON


def test_explicit_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend(Backend.TRITON, torch.device("cpu"))
    assert resolve_backend(Backend.REFERENCE, torch.device("cpu")) is Backend.REFERENCE


def test_kernels_package_import_is_cheap():
    # transformers may import a top-level `kernels` while probing for Hugging Face's package.
    import subprocess
    import sys

    code = "import sys, specmask.kernels; assert 'torch' not in sys.modules and 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
