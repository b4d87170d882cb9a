"""Grammar policy: engines, what is refused, what is rewritten, forced continuations."""
