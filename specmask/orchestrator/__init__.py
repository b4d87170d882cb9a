"""Orchestrator: the gRPC API clients call, admission, continuous batching, the step loop."""

import specmask.proto  # noqa: F401  (before any gRPC use: turns gRPC fork support off; see specmask/proto/__init__.py)
