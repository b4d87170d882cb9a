"""What a caller that drives sessions needs of the mask service.

Two implement ``MaskService``: the router over replicas (``router.MaskRouter``) and a
client of one replica (``mask_client.MaskServiceClient``); a worker's ``MaskChannel``
takes either. Nothing imports this at run time; mypy checks each implementation where
it is passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from specmask.common.grammar_spec import GrammarSpec
    from specmask.mask_service.client.mask_client import DraftMaskItem, DraftMaskOutcome, DraftMaskResult
    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

__all__ = ["MaskService"]


class MaskService(Protocol):
    """Session calls of the mask service, on one replica or routed over several."""

    def open_session(
        self, tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None = None, *, request_id: str = ""
    ) -> str: ...

    def open_session_info(
        self, tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None = None, *, request_id: str = ""
    ) -> pb.OpenSessionResponse:
        """``open_session`` with what the session is: its id (``session_id``), width and the
        stop tokens its grammar ends on (``stop_token_ids``)."""
        ...

    def commit(self, session_id: str, seq: int, tokens: Sequence[int]) -> bool: ...

    def draft_masks(self, items: Sequence[DraftMaskItem]) -> list[DraftMaskResult]: ...

    def draft_mask_items(self, items: Sequence[DraftMaskItem]) -> list[DraftMaskOutcome]:
        """Per item, its rows or its own error (``draft_masks`` raises the first)."""
        ...

    def close_session(self, session_id: str) -> None: ...

    def session_count(self) -> int: ...

    def close(self) -> None: ...
