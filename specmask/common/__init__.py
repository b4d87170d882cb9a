"""Types and process plumbing every SpecMask process shares (no engine, no torch)."""
