"""Orchestrator: the gRPC API clients call, admission, continuous batching, the step loop."""
