"""The distilled draft: built by the same code as `specmask models distill`, on the tiny pair.

The build runs the whole pipeline (generated schemas, the target's constrained
greedy decodes with xgrammar masks, a draft made of one target layer plus the
target's frozen tied embedding, distillation) at toy size in seconds. The draft
then drafts with grammar masks in a real worker against a real mask service,
and greedy speculative decoding must equal plain constrained greedy decoding.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from specmask.gpu_worker.loading import DRAFT_VOCAB_FILE
from specmask.gpu_worker.models.distill import DistillConfig, distill_draft
from specmask.gpu_worker.models.sources import ModelSource, sha256_file
from specmask.gpu_worker.types import SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import torch_threads

EOS = (0,)  # the tiny pair's <|eos|>
MAX_TOKENS = 40
# One of the tiny target's two layers: a real (smaller) draft, not a copy of the target.
# Its LM head scores about half of the tiny vocabulary (TINY_VOCAB_SIZE = 300), so the worker runs
# the restricted head, and rows whose allowed tokens all lie outside it propose nothing.
TINY = DistillConfig(
    layers=(0,), num_schemas=8, max_new_tokens=24, max_prompt_tokens=240, epochs=1, accumulate=2, draft_vocab=160
)
SCHEMAS = {
    "record": {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["status", "count", "ok"],
        "additionalProperties": False,
    },
    "user": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
}


@pytest.fixture(scope="module")
def mask_service(tiny_pair: tuple[Path, Path]) -> Iterator[Any]:
    """A real mask service for the tiny pair whose compile workers run at normal priority: at the
    default (nice 19, SCHED_IDLE) a saturated shared box starves them past the worker's deadline,
    and this module tests the draft's exactness, not compile scheduling."""
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    config = MaskServiceConfig(
        tokenizers=(TokenizerSource(str(tiny_pair[0])),),
        host="127.0.0.1",
        port=0,
        mask_threads=1,
        compile_nice=0,
        compile_sched_idle=False,
    )
    handle = build_service(config)
    handle.server.start()
    yield handle
    handle.stop(grace_s=1.0)


@pytest.fixture(scope="module")
def mask_address(mask_service: Any) -> str:
    return f"127.0.0.1:{mask_service.port}"


@pytest.fixture(scope="module")
def distilled(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("distilled") / "draft"
    with torch_threads(1):
        info = distill_draft(tiny_pair[0], out, TINY, progress=False)
    return out, info


def test_build_is_a_smaller_draft_sharing_tokenizer_and_embedding(tiny_pair, distilled) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from specmask.gpu_worker.models.resolve import check_same_tokenizer

    draft_dir, info = distilled
    target_dir = tiny_pair[0]
    check_same_tokenizer(str(target_dir), str(draft_dir))  # raises on a vocabulary mismatch
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), local_files_only=True)
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), local_files_only=True)
    assert draft.config.num_hidden_layers == 1 < target.config.num_hidden_layers
    assert draft.config.vocab_size == target.config.vocab_size
    # The embedding (and the tied head) is the target's, frozen through training.
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert draft.get_output_embeddings().weight.data_ptr() == draft.get_input_embeddings().weight.data_ptr()
    assert info["teacher_decodes"] > 0 and info["teacher_positions"] > info["teacher_forced_positions"] > 0
    assert len(info["heldout_acceptance_by_position"]) == 4
    # The draft vocabulary: TINY.draft_vocab sorted, distinct ids, the ones the teacher used among them.
    ids = json.loads((draft_dir / DRAFT_VOCAB_FILE).read_text())
    assert info["draft_vocab"] == len(ids) == TINY.draft_vocab
    assert ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] < target.config.vocab_size


def test_build_is_reproducible(tiny_pair, distilled, tmp_path: Path) -> None:
    again = tmp_path / "again"
    with torch_threads(1):
        info = distill_draft(tiny_pair[0], again, TINY, progress=False)
    first, first_info = distilled
    assert sha256_file(again / "model.safetensors") == sha256_file(first / "model.safetensors")
    assert info["final_loss"] == first_info["final_loss"]


def test_workers_share_a_draft_with_a_vocabulary(tiny_pair, distilled) -> None:
    """A second worker over the first's weights (bench.step_cost's replay peer) keeps the draft's
    restricted head as it is: restricting it again would index the full vocabulary into it."""
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig

    draft_dir, info = distilled
    config = WorkerConfig(target_dir=str(tiny_pair[0]), draft_dir=str(draft_dir), device="cpu", dtype="float32")
    first = GpuWorker(config)
    second = GpuWorker(config, target_model=first.target.model, draft_model=first.draft.model)
    try:
        for worker in (first, second):
            assert worker.draft is not None and worker.draft.output_ids is not None
            assert worker.draft.model.get_output_embeddings().weight.shape[0] == info["draft_vocab"]
        assert second.draft.model is first.draft.model
        assert second.draft.output_ids.tolist() == first.draft.output_ids.tolist()
    finally:
        second.shutdown()
        first.shutdown()


@pytest.fixture(scope="module")
def references(tiny_pair) -> dict[str, tuple[list[int], list[int], str]]:
    from transformers import AutoTokenizer

    from tests.gpu_worker.reference import compile_grammar, greedy_constrained

    target_dir = tiny_pair[0]
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    refs = {}
    with torch_threads(1):
        for name, schema in SCHEMAS.items():
            prompt = tok.encode(f"Generate JSON for schema {name}:\n")
            compiled = compile_grammar(target_dir, "json_schema", json.dumps(schema), EOS)
            ref = greedy_constrained(target_dir, prompt, compiled, EOS, MAX_TOKENS)
            refs[name] = (prompt, ref.tokens, ref.finish)
    return refs


def _run_retrying_compiles(worker: Any, seqs: list[Any], deadline_s: float = 600.0) -> dict[str, Any]:
    """Run ``seqs`` to completion; a sequence refused with "still compiling, retry" (a busy box can
    hold a compile past the worker's mask deadline) is sent again until ``deadline_s``."""
    from tests.gpu_worker.helpers import run_to_completion

    pending = {s.seq_id: s for s in seqs}
    results: dict[str, Any] = {}
    end = time.monotonic() + deadline_s
    while pending:
        assert worker.add(list(pending.values())) == [None] * len(pending)
        for seq_id, got in run_to_completion(worker).items():
            retry = got.error is not None and "still compiling" in got.error and not got.tokens
            if retry and time.monotonic() < end:
                continue
            results[seq_id] = got
            pending.pop(seq_id)
    return results


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_distilled_draft_matches_plain_constrained_decoding(make_worker, distilled, references, k) -> None:
    from specmask.common.grammar_spec import GrammarKind, GrammarSpec
    from specmask.gpu_worker.types import NewSequence

    worker = make_worker(draft_dir=str(distilled[0]))
    spec = SpeculationParams(k=k, proposers=("draft_model", "grammar_forced"), draft_masking=True)
    seqs = [
        NewSequence(
            name,
            tuple(references[name][0]),
            GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)),
            SamplingParams(max_tokens=MAX_TOKENS),
            spec,
        )
        for name, schema in SCHEMAS.items()
    ]
    assert worker.draft is not None and worker.draft.vocab_size == TINY.draft_vocab  # the restricted head
    results = _run_retrying_compiles(worker, seqs)
    for name in SCHEMAS:
        got = results[name]
        assert got.error is None, got.error
        assert list(got.tokens) == references[name][1], name
    assert sum(results[name].drafts_proposed for name in SCHEMAS) > 0  # the draft did draft


@dataclass(frozen=True)
class _CopiedDir(ModelSource):
    """A registered model that is a copy of a local directory (the tiny target)."""

    path: str

    def recipe(self) -> dict[str, Any]:
        return {"kind": "copied-dir", "path": self.path}

    def build(self, out_dir: Path, deps: Mapping[str, Path], *, progress: bool) -> dict[str, Any]:
        shutil.copytree(self.path, out_dir)
        return {}


def test_cached_distilled_draft_is_the_default_and_is_never_built_implicitly(
    tiny_pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specmask.gpu_worker.models import registry
    from specmask.gpu_worker.models.cache import CACHE_ENV, ensure_model, read_manifest
    from specmask.gpu_worker.models.resolve import default_draft, draft_hint, resolve_pair
    from specmask.gpu_worker.models.sources import DistilledDraftSource

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(registry.MODELS, "tiny", _CopiedDir(str(tiny_pair[0])))
    monkeypatch.setitem(
        registry.MODELS, "tiny-draft", DistilledDraftSource(base="tiny", layers=(0,), num_schemas=8, epochs=1)
    )
    monkeypatch.setitem(registry.DISTILLED_DRAFTS, "tiny", "tiny-draft")

    assert default_draft("tiny") is None  # not built: no draft, and nothing is built
    assert not (tmp_path / "cache" / "tiny-draft").exists()
    target_dir, draft_dir = resolve_pair("tiny", None)
    assert draft_dir is None
    assert "specmask models distill tiny" in (draft_hint("tiny", draft_dir) or "")

    with torch_threads(1):
        built = ensure_model("tiny-draft")
    manifest = read_manifest(built) or {}
    assert manifest["recipe"] == registry.MODELS["tiny-draft"].recipe()
    assert manifest["info"]["teacher_decodes"] > 0

    assert default_draft("tiny") == "tiny-draft"
    assert resolve_pair("tiny", None) == (target_dir, str(built))
    assert draft_hint("tiny", str(built)) is None
    assert resolve_pair("tiny", "none") == (target_dir, None)
    # A copy that no longer matches its manifest is not picked up.
    (built / "model.safetensors").write_bytes(b"corrupt")
    assert default_draft("tiny") is None
