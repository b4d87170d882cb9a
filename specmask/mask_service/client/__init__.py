"""The mask service as its callers see it: client, replica router, row table."""
