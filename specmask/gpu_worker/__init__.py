"""GPU worker: Ray actors owning the draft and target models, KV caches, propose/verify."""
