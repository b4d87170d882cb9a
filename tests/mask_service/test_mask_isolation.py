"""Per-item isolation in DraftMasks and forced continuations through UTF-8 characters.

Grammars whose forced text stops inside (or starts inside) a multi-byte UTF-8
character must neither fail their own item nor anyone else's: the forced walk works
in bytes and proposes whole tokens, and an error in one item of a call fails that
item alone. Real engines, real gRPC, the raw stub (the client raises for the first
failed item; here every item's own result is read).
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient
from specmask.mask_service.server.server import MaskServiceHandle
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc

HEALTHY = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "array", "items": {"type": "integer"}}))

OBJ = json.dumps(
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
)
# (grammar, separators, text a valid output starts with); each one's forced text reaches
# inside a multi-byte character at the start or after the first byte token.
POISONED: list[tuple[GrammarKind, str, tuple[str, str] | None, str]] = [
    (GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "pattern": "^[é-ü]+$"}), None, '"é'),
    (GrammarKind.REGEX, "😀+", None, "😀😀"),
    (GrammarKind.EBNF, 'root ::= "é" | "😀" "+"', None, "😀+"),
    (GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "const": "日本語テキスト"}), None, '"日本語'),
    (GrammarKind.JSON_SCHEMA, OBJ, (",", ":\u2028"), '{"a":\u20281,"b":\u2028'),
    (GrammarKind.JSON_SCHEMA, OBJ, (" , ", " : "), '{"a" : 1 , "b" : '),
]
ENGINES = ("xgrammar", "llguidance")


def _spec(kind: GrammarKind, text: str, separators: tuple[str, str] | None, backend: str) -> GrammarSpec:
    if kind is GrammarKind.EBNF and backend == "llguidance":  # its dialect is Lark
        kind, text = GrammarKind.LARK, text.replace("root ::=", "start:")
    return GrammarSpec(kind, text, separators=separators, backend=backend)


def _byte_prefixes(hf_tok: Any, text: str) -> list[list[int]]:
    """Token-id prefixes of ``text``'s canonical encoding (each a state the walk may stop in)."""
    ids = list(hf_tok.encode(text, add_special_tokens=False))
    return [ids[:n] for n in range(min(len(ids), 4) + 1)]  # + 4 forced <= max_k 8 (conftest)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize(("kind", "text", "separators", "sample"), POISONED)
def test_poisoned_item_fails_nobody_else(
    client: MaskServiceClient,
    service: MaskServiceHandle,
    bpe_id: str,
    hf_tok: Any,
    backend: str,
    kind: GrammarKind,
    text: str,
    separators: tuple[str, str] | None,
    sample: str,
) -> None:
    healthy = [client.open_session(bpe_id, HEALTHY) for _ in range(2)]
    poisoned = client.open_session(bpe_id, _spec(kind, text, separators, backend))
    start = list(hf_tok.encode("[1", add_special_tokens=False))
    forced_seen = False
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
        stub = pb_grpc.MaskServiceStub(channel)
        for drafts in _byte_prefixes(hf_tok, sample):
            items = [
                pb.DraftMaskItem(session_id=healthy[0], draft_tokens=start, forced_up_to=len(start) + 4),
                pb.DraftMaskItem(
                    session_id=poisoned, draft_tokens=drafts, last_row_only=True, forced_up_to=len(drafts) + 4
                ),
                pb.DraftMaskItem(session_id=poisoned, draft_tokens=drafts, forced_up_to=len(drafts) + 4),
                pb.DraftMaskItem(session_id=healthy[1], draft_tokens=start, last_row_only=True),
            ]
            resp = stub.DraftMasks(pb.DraftMasksRequest(items=items, client_id="isolation"), timeout=120)
            results = list(resp.results)
            assert len(results) == len(items)
            for i in (0, 3):  # the healthy items always get their rows
                assert results[i].error_code == 0, results[i].error_message
                assert results[i].num_grammar_accepted == len(start)
                assert results[i].num_rows == (1 if i == 3 else len(start) + 1)
            for r in results[1:3]:  # and the poisoned one is not poisoned any more
                assert r.error_code == 0, r.error_message
                assert r.num_grammar_accepted == len(drafts)
                # Forced tokens are whole tokens the grammar accepts after the drafts.
                assert _accepted(client, poisoned, drafts, tuple(r.forced_tokens)), (drafts, r.forced_tokens)
                forced_seen |= bool(r.forced_tokens) and _spells_utf8_tail(drafts, r.forced_tokens, hf_tok)
    # The walk proposes through a character the drafts stopped inside (or before).
    assert forced_seen or sample.isascii()
    # Asking for masks never moved committed state, and every session still works.
    for sid in [*healthy, poisoned]:
        assert client.draft_masks([DraftMaskItem(sid, [])])[0].num_grammar_accepted == 0
        client.close_session(sid)


def _token_bytes(hf_tok: Any, token: int) -> bytes:
    piece = hf_tok.convert_ids_to_tokens(int(token))
    return bytes(_BYTE_DECODER[c] for c in piece)


def _spells_utf8_tail(drafts: list[int], forced: Any, hf_tok: Any) -> bool:
    """Whether drafts + forced cross a multi-byte character boundary inside the forced part."""
    done = b"".join(_token_bytes(hf_tok, t) for t in drafts)
    more = b"".join(_token_bytes(hf_tok, t) for t in forced)
    return any(b >= 0x80 for b in more) and bool(done + more)


def _accepted(client: MaskServiceClient, sid: str, drafts: list[int], forced: tuple[int, ...]) -> bool:
    walked = client.draft_masks([DraftMaskItem(sid, [*drafts, *forced], last_row_only=True)])[0]
    return walked.num_grammar_accepted == len(drafts) + len(forced)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table (byte-level BPE token strings)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _bytes_to_unicode()
