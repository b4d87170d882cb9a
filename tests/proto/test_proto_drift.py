"""Generated stubs in proto/gen match a fresh `python -m specmask.proto.codegen`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def test_proto_gen_in_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("grpc_tools")
    # protoc plugins (protoc-gen-mypy) live next to the interpreter in the venv.
    bindir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", bindir + os.pathsep + os.environ.get("PATH", ""))
    from specmask.proto import codegen

    assert codegen.check() == []


def test_mask_service_descriptor() -> None:
    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["MaskService"].methods}
    assert {"ValidateGrammar", "OpenSession", "Commit", "CloseSession", "DraftMasks"} <= methods
