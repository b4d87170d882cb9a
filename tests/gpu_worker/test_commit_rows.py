"""Every committed token is allowed by the row of its exact grammar state (docs/design.md "Never lie").

The mask service refuses a commit its grammar rejects, but that is the backstop: a token
outside its row must never reach a commit. This test checks the worker's output itself,
token by token, against rows computed independently: a fresh xgrammar matcher compiled
for the schema, fed the committed prefix (no worker code, no row table, no service).

The model pair's tokenizer has two special tokens that end text, ``<|eos|>`` (the
tokenizer's EOS: the worker's stop set) and ``<|endoftext|>``, which the mask service
also counts as a stop token of every grammar (it detects both, as it does for SmolLM2,
whose ``<|endoftext|>`` and ``<|im_end|>`` it both takes). Where the document may end, a
row allows either; a grammar is over once one of them is taken, and the service walks
nothing past that state, so a sequence must end there too, whichever of them ended it.

Randomised over every proposer subset, speculation off, k, draft-side masking, greedy
and seeded sampling, and a target drafting for itself (drafts accepted deep into the
step) or a weaker draft. The prompts hold the schemas' descriptions with raw newlines
and quotes, which the n-gram proposer copies into JSON strings, where they are illegal.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion, serving_masks, torch_threads

SECOND_STOP = "<|endoftext|>"
DESCRIPTION = 'A long description.\nIt has "quoted" words,\nnew lines\tand tabs\\ and "x":"y",\n# More\n\n'
SCHEMAS = {
    "bare_string": {"type": "string", "description": DESCRIPTION},
    "object": {
        "type": "object",
        "properties": {"note": {"type": "string", "description": DESCRIPTION}, "n": {"type": "integer"}},
        "required": ["note", "n"],
        "additionalProperties": False,
    },
}
PROPOSERS = ("draft_model", "grammar_forced", "ngram")
PROPOSER_SETS = [c for r in range(1, len(PROPOSERS) + 1) for c in itertools.combinations(PROPOSERS, r)]
KS = (1, 2, 3, 4, 6, 8)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def two_stop_pair(tmp_path_factory: pytest.TempPathFactory, tiny_pair: tuple[Path, Path]) -> tuple[Path, Path]:
    """The tiny pair's tokenizer plus a second special token, on a fresh random-init pair."""
    import torch
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_models import build_tiny_model_pair

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.add_special_tokens({"additional_special_tokens": [SECOND_STOP]})
    tok_dir = tmp_path_factory.mktemp("two-stop-tokenizer")
    tok.save_pretrained(str(tok_dir))
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        return build_tiny_model_pair(
            tmp_path_factory.mktemp("two-stop-pair"), vocab_from=tok_dir, max_position_embeddings=1024
        )


@pytest.fixture(scope="module")
def two_stop_service(two_stop_pair: tuple[Path, Path]) -> Iterator[Any]:
    with serving_masks(two_stop_pair[0]) as handle:
        yield handle


@pytest.fixture(scope="module")
def grammar_stops(two_stop_pair: tuple[Path, Path], two_stop_service: Any) -> tuple[int, ...]:
    """The stop tokens of the service's grammars: EOS and the second special token."""
    from transformers import AutoTokenizer

    from specmask.mask_service.server.tokenizers import TokenizerSource, load_tokenizer

    tok = AutoTokenizer.from_pretrained(str(two_stop_pair[0]))
    stops = (int(tok.eos_token_id), int(tok.convert_tokens_to_ids(SECOND_STOP)))
    # The premise: the service's grammars end on both, the worker's EOS is only the first.
    assert set(load_tokenizer(TokenizerSource(str(two_stop_pair[0]))).stop_token_ids) == set(stops)
    return stops


def _reference(model_dir: Path, schema: str, stops: tuple[int, ...]) -> Any:
    """A fresh xgrammar matcher for ``schema``, compiled as the service compiles it."""
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=list(stops))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        schema, any_whitespace=False, separators=(",", ":"), strict_mode=True
    )
    return xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)


def _allowed(matcher: Any, bitmask: Any, token: int) -> bool:
    """Whether the row of the matcher's state allows ``token``: [1, W] int32, bit t of word t // 32."""
    matcher.fill_next_token_bitmask(bitmask)
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def _sequences(prompt: tuple[int, ...], rng: random.Random) -> dict[str, tuple[NewSequence, str]]:
    """One sequence per schema, sampling mode and speculation setting: every proposer subset
    with and without draft-side masking, and speculation off; a random k each."""
    specs = [
        SpeculationParams(k=rng.choice(KS), proposers=props, draft_masking=masking)
        for props in PROPOSER_SETS
        for masking in (True, False)
    ]
    specs.append(SpeculationParams(enabled=False, k=0, draft_masking=False))
    out = {}
    for (name, schema), temperature, spec in itertools.product(SCHEMAS.items(), (0.0, 1.0), specs):
        mode = f"k{spec.k}-{'+'.join(spec.proposers)}-m{int(spec.draft_masking)}" if spec.enabled else "off"
        seq_id = f"{name}-t{temperature:g}-{mode}"
        text = json.dumps(schema)
        sampling = SamplingParams(temperature=temperature, seed=rng.randrange(1 << 30), max_tokens=MAX_TOKENS)
        out[seq_id] = (NewSequence(seq_id, prompt, GrammarSpec(GrammarKind.JSON_SCHEMA, text), sampling, spec), text)
    return out


# "target": the target drafts for itself, so drafts are accepted deep into a step.
@pytest.mark.parametrize(("drafter", "seed"), [("draft", 0), ("target", 1)])
def test_every_committed_token_is_allowed_by_its_states_row(
    two_stop_pair: tuple[Path, Path], two_stop_service: Any, grammar_stops: tuple[int, ...], drafter: str, seed: int
) -> None:
    from transformers import AutoTokenizer

    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig

    target, draft = two_stop_pair
    tok = AutoTokenizer.from_pretrained(str(target))
    # The schemas' text, then their descriptions raw and inside a JSON string: n-gram material.
    text = f'Schema: {json.dumps(SCHEMAS["object"])}\n{DESCRIPTION}"{DESCRIPTION}"\n'
    prompt = tuple(tok.encode(text))
    seqs = _sequences(prompt, random.Random(seed))
    worker = GpuWorker(
        WorkerConfig(
            target_dir=str(target),
            draft_dir=str(target if drafter == "target" else draft),
            device="cpu",
            dtype="float32",
            mask_service_addresses=(f"127.0.0.1:{two_stop_service.port}",),
            mask_deadline_s=20.0,
            max_batch=len(seqs),
            seed=seed,
        )
    )
    try:
        assert worker.add([s for s, _ in seqs.values()], wait_for_sessions=True) == [None] * len(seqs)
        with torch_threads(1):
            results = run_to_completion(worker)
    finally:
        worker.shutdown()

    problems = []
    for seq_id, (_, schema) in seqs.items():
        r = results[seq_id]
        matcher, bitmask = _reference(target, schema, grammar_stops)
        for i, token in enumerate(r.tokens):
            if token in grammar_stops:
                problems.append(f"{seq_id}: stop token {token} returned as output at {i}: {r.tokens}")
                break
            if not _allowed(matcher, bitmask, token):
                problems.append(f"{seq_id}: token {token} at {i} is outside its row: {r.tokens}")
                break
            assert matcher.accept_token(token)
        else:
            if r.error is not None or r.finish not in (FinishReason.GRAMMAR_COMPLETE, FinishReason.LENGTH):
                problems.append(f"{seq_id}: finished {r.finish} ({r.error})")
            elif r.finish is FinishReason.GRAMMAR_COMPLETE:
                ending = [stop for stop in grammar_stops if _allowed(matcher, bitmask, stop)]
                if not ending:
                    problems.append(f"{seq_id}: complete where the grammar may not end: {r.tokens}")
    assert not problems, "\n".join(problems)
