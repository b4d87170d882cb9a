"""CPU grammar-mask service: compiled grammars, per-request sessions, batched draft-position bitmasks.

Subpackages: ``grammar`` (engines, routing between them, schema checks and rewrites,
forced continuations), ``server`` (compile pool and cache, sessions, the DraftMasks hot
path, the gRPC servicer and main), ``client`` (the worker's client, replica router, row
table); ``wire`` is the compact row format and ``convert`` maps specs to and from proto.
What a grammar is refused for, rewritten to, and checked against (never a session that
silently allows more) is in docs/grammars.md; the step it serves, docs/design.md step 2.
"""

import specmask.proto  # noqa: F401  (before any gRPC use: turns gRPC fork support off; see specmask/proto/__init__.py)
