"""A reasoning model under a JSON Schema: free thinking, then the schema, on one grammar.

A tiny random-initialised Qwen3 pair with the real Qwen3 tokenizer and chat
template, whose logits are scripted (bench.gpu.ScriptedLogits: +1e4 on the next
token of a fixed output) to think, with text that would break the schema, and then
answer. Through the real mask service and worker, with speculation off and on
(draft model with draft masks and forced runs, the draft scripted wrong at some
positions so drafts are rejected on both sides of the section's end), the output is
the script token for token, the grammar completes, and the end
check passes it: non-empty reasoning, schema-valid content.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from bench import gpu
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.reasoning import FORMATS, ReasoningParser, split_answer
from tests.fixtures.shared_data import shared_data_dir
from tests.gpu_worker.helpers import run_to_completion

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

VOCAB = gpu.SHAPES["tiny-qwen3"]["vocab_size"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
THINKING = '\nThe user wants {"name": 1}? No: a name </thin and an age < 200.\n'
ANSWER = '{"name":"Ada","age":36}'
QWEN3 = FORMATS[ReasoningParser.QWEN3]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = shared_data_dir()
    if shared is None or not (shared / "tokenizers" / "qwen3" / "tokenizer.json").is_file():
        pytest.skip("the Qwen3 tokenizer is not in the shared data")
    out = tmp_path_factory.mktemp("qwen3") / "model"
    gpu.prepare_tokenizer("qwen3", out)
    return out


@pytest.fixture(scope="module")
def service(qwen3_dir: Path) -> Iterator[Any]:
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    config = MaskServiceConfig(
        tokenizers=(TokenizerSource(str(qwen3_dir), vocab_size=VOCAB),), host="127.0.0.1", port=0, mask_threads=1
    )
    handle = build_service(config)
    handle.server.start()
    yield handle
    handle.stop(grace_s=1.0)


def _script(qwen3_dir: Path, tag: str) -> tuple[tuple[int, ...], tuple[int, ...], Any]:
    """(prompt, the output the logits are scripted to, the tokenizer): the prompt is the real
    template's (thinking on), unique per ``tag`` (ScriptedLogits matches scripts by prompt)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(qwen3_dir))
    messages = [{"role": "user", "content": f"Describe Ada ({tag}) as JSON."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")  # thinking on: the model opens <think> itself
    prompt_ids = tuple(tok.encode(prompt, add_special_tokens=False))
    out = tok.encode(f"<think>{THINKING}</think>\n\n{ANSWER}", add_special_tokens=False)
    out.append(tok.convert_tokens_to_ids("<|im_end|>"))
    assert out[0] == tok.convert_tokens_to_ids("<think>")  # one token, as the model writes it
    return prompt_ids, tuple(out), tok


@pytest.mark.parametrize(
    ("mode", "speculation"),
    [
        ("nospec", SpeculationParams(enabled=False)),
        ("spec", SpeculationParams(k=4, proposers=("draft_model", "grammar_forced"), draft_masking=True)),
    ],
)
def test_thinks_then_answers_the_schema(qwen3_dir: Path, service: Any, mode: str, speculation: Any) -> None:
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig

    prompt, script, tok = _script(qwen3_dir, mode)
    target = gpu.build_model("tiny-qwen3", torch.float32, torch.device("cpu"), seed=1)
    draft = gpu.build_model("tiny-qwen3-draft", torch.float32, torch.device("cpu"), seed=2)
    worker = GpuWorker(
        WorkerConfig(
            target_dir=str(qwen3_dir),
            draft_dir=str(qwen3_dir),
            device="cpu",
            dtype="float32",
            mask_service_addresses=(f"127.0.0.1:{service.port}",),
            mask_deadline_s=120.0,
            max_model_len=512,
        ),
        target_model=target,
        draft_model=draft,
    )
    try:
        scripts = gpu.ScriptedLogits(VOCAB)
        scripts.register([gpu.ScriptedSequence(mode, "reasoning", prompt, prompt + script)])
        scripts.install(worker.target)
        assert worker.draft is not None
        scripts.install(worker.draft, agreement=0.7)  # some drafts wrong: rejections on the way
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), reasoning=QWEN3.section)
        seq = NewSequence(mode, prompt, spec, SamplingParams(max_tokens=len(script) + 8), speculation)
        for _ in range(30):  # a busy box may refuse a grammar still compiling: add it again
            [error] = worker.add([seq], wait_for_sessions=True)
            if error is None or "still compiling" not in error:
                break
        assert error is None, error
        got = run_to_completion(worker)[mode]
    finally:
        worker.shutdown()
    assert got.error is None, got.error
    # The grammar ends with the object; <|im_end|> is emitted too where the step reached it.
    body = got.tokens[:-1] if got.tokens[-1:] == [script[-1]] else got.tokens
    assert tuple(body) == script[:-1], tok.decode(got.tokens)
    assert got.finish is FinishReason.GRAMMAR_COMPLETE
    if mode == "spec":
        assert got.drafts_accepted > 0 and got.drafts_proposed > got.drafts_accepted
    text = tok.decode(body)
    assert OutputChecker().check(spec, text).ok
    answer = split_answer(QWEN3, text)
    assert answer.reasoning == THINKING and answer.content == ANSWER
    jsonschema.validate(json.loads(answer.content), SCHEMA)
    # The section is the caller's grammar's only way in: the same text without it fails the end check.
    assert not OutputChecker().check(spec, ANSWER).ok
    assert not OutputChecker().check(spec, f"<think>{THINKING}").ok
