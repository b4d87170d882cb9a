"""The draft proposers a request can name: one enum for the API, the wire and the worker.

A ``StrEnum``: each member is its wire/config string (``ProposerKind.NGRAM == "ngram"``), so
request JSON, the gRPC mapping, ``SpeculationParams.proposers`` and the worker's registry
(gpu_worker.proposers.registry, keyed by ``Proposer.name``) keep the same values, while code
names a proposer only through this enum (tests/test_proposer_names.py checks that no other
module spells one as a string).
"""

from __future__ import annotations

import enum


class ProposerKind(enum.StrEnum):
    """A draft proposer (gpu_worker.proposers): what fills a draft position."""

    GRAMMAR_FORCED = "grammar_forced"  # the grammar's only allowed token (q = 1)
    NGRAM = "ngram"  # prompt lookup: the continuation of the context's latest repeat
    DRAFT_MODEL = "draft_model"  # the draft model's sample (q = its distribution)
