"""Mask service: CPU gRPC service holding xgrammar matchers; batched draft-position bitmasks."""
