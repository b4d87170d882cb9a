"""Greedy speculative decoding == plain constrained greedy decoding on the real default model
(SmolLM2-135M-Instruct), with chat prompts and the drafts it runs with by default.

Needs the converted model in the cache (`specmask models get smollm2-135m-instruct`); skipped
otherwise: tests never download weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from specmask.orchestrator.chat import ChatMessage, ChatPrompt, ChatRenderer
from tests.gpu_worker.helpers import run_to_completion, torch_threads
from tests.gpu_worker.reference import compile_grammar, greedy_constrained

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 40
SCHEMAS = {
    "user": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    "ticket": {
        "type": "object",
        "properties": {
            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        "required": ["priority", "tags"],
    },
}
ASKS = {"user": "A user called Ada, aged 36.", "ticket": "File an urgent ticket about a broken login page."}


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path) -> Path:
    return smollm2_dir


@pytest.fixture(scope="module")
def mask_address(model_dir: Path) -> Iterator[str]:
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    service = build_service(
        MaskServiceConfig(tokenizers=(TokenizerSource(str(model_dir)),), host="127.0.0.1", port=0, mask_threads=1)
    )
    service.server.start()
    yield f"127.0.0.1:{service.port}"
    service.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def worker(model_dir: Path, mask_address: str):
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig

    w = GpuWorker(
        WorkerConfig(
            target_dir=str(model_dir), device="cpu", mask_service_addresses=(mask_address,), mask_deadline_s=60.0
        )
    )
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def cases(model_dir: Path, worker) -> dict[str, tuple[list[int], GrammarSpec, object]]:
    """name -> (chat prompt ids as the orchestrator tokenizes them, grammar, reference output)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    renderer = ChatRenderer.for_model(str(model_dir))
    stop_ids = worker.info().eos_token_ids
    out = {}
    with torch_threads(1):
        for name, schema in SCHEMAS.items():
            spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
            text = renderer.render(ChatPrompt((ChatMessage("user", ASKS[name]),)), spec)
            ids = tok.encode(text).ids
            compiled = compile_grammar(model_dir, "json_schema", spec.text, stop_ids)
            out[name] = (ids, spec, greedy_constrained(model_dir, ids, compiled, stop_ids, MAX_TOKENS))
    return out


@pytest.mark.parametrize(
    "spec",
    [
        SpeculationParams(k=4, proposers=("grammar_forced", "ngram"), draft_masking=False),
        SpeculationParams(k=8, proposers=("grammar_forced",), draft_masking=False),
        SpeculationParams(enabled=False, k=0),
    ],
    ids=["forced+ngram-k4", "forced-k8", "nospec"],
)
def test_real_model_greedy_matches_plain_constrained(worker, cases, spec: SpeculationParams) -> None:
    _assert_greedy_matches_plain_constrained(worker, cases, spec)


def _assert_greedy_matches_plain_constrained(worker, cases, spec: SpeculationParams) -> dict:
    """Every case decoded with ``spec`` on ``worker``: the reference's tokens and finish, and a
    finished document parses. Returns the per-case results."""
    seqs = [
        NewSequence(name, tuple(ids), grammar, SamplingParams(max_tokens=MAX_TOKENS), spec)
        for name, (ids, grammar, _) in cases.items()
    ]
    with torch_threads(1):
        assert worker.add(seqs) == [None] * len(seqs)
        results = run_to_completion(worker)
    for name, (_, _, ref) in cases.items():
        got = results[name]
        assert got.error is None, got.error
        assert got.tokens == ref.tokens, f"{name}: {got.tokens} != {ref.tokens} (min top-2 gap {ref.min_gap:.2e})"
        expected = FinishReason.LENGTH if ref.finish == "length" else FinishReason.GRAMMAR_COMPLETE
        assert got.finish is expected
        if ref.finish == "stop":
            json.loads(worker.tokenizer.decode(got.tokens))  # a finished document parses
    return results


@pytest.fixture(scope="module")
def draft_worker(model_dir: Path, mask_address: str):
    """A worker with the distilled draft (its restricted LM head included); skipped when the
    draft is not built (tests never build it: `specmask models distill` does)."""
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig
    from specmask.gpu_worker.models.cache import cached_model
    from specmask.gpu_worker.models.registry import DEFAULT_MODEL, DISTILLED_DRAFTS

    name = DISTILLED_DRAFTS[DEFAULT_MODEL]
    draft = cached_model(name)
    if draft is None:
        pytest.skip(f"{name} is not built; run `specmask models distill {DEFAULT_MODEL}`")
    w = GpuWorker(
        WorkerConfig(
            target_dir=str(model_dir),
            draft_dir=str(draft),
            device="cpu",
            mask_service_addresses=(mask_address,),
            mask_deadline_s=60.0,
        )
    )
    yield w
    w.shutdown()


def test_distilled_draft_greedy_matches_plain_constrained(draft_worker, cases) -> None:
    spec = SpeculationParams(k=4, proposers=("draft_model", "grammar_forced"), draft_masking=True)
    results = _assert_greedy_matches_plain_constrained(draft_worker, cases, spec)
    assert sum(results[name].drafts_accepted for name in cases) > 0  # the draft drafted, and was right


def test_references_are_nontrivial(cases) -> None:
    assert all(len(ref.tokens) > 5 for _, _, ref in cases.values())
    assert any(ref.finish == "stop" for _, _, ref in cases.values())
