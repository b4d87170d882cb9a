"""Chat prompts: messages rendered with the model's own chat template, the JSON Schema
instruction (default, merged, overridden, off), bad conversations refused with INVALID_ARGUMENT,
and the proto round trip."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.gpu_worker.types import WorkerInfo
from specmask.orchestrator.chat import DEFAULT_SCHEMA_INSTRUCTION, ChatError, ChatMessage, ChatPrompt, ChatRenderer
from specmask.orchestrator.convert import request_from_proto, request_to_proto
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker
from specmask.orchestrator.types import GenerationRequest
from specmask.orchestrator.validation import RequestValidator, ServingDefaults
from tests.fixtures.tokenizers import build_bpe_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SCHEMA_SPEC = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA, indent=2))
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test BPE tokenizer plus ChatML special tokens and a chat template in tokenizer_config.json."""
    from tokenizers import Tokenizer

    out = build_bpe_tokenizer(tmp_path_factory.mktemp("chat-tok"))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATE, eos_token="<|im_end|>")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer(chat_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(chat_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def renderer(chat_dir: Path) -> ChatRenderer:
    return ChatRenderer.for_model(str(chat_dir))


@pytest.fixture(scope="module")
def validator(chat_dir: Path, tokenizer, renderer: ChatRenderer) -> Iterator[RequestValidator]:
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    service = build_service(
        MaskServiceConfig(tokenizers=(TokenizerSource(str(chat_dir)),), host="127.0.0.1", port=0, mask_threads=1)
    )
    service.server.start()
    info = WorkerInfo(
        vocab_size=tokenizer.get_vocab_size(),
        max_model_len=4096,
        tokenizer_id=tokenizer_id_for_path(chat_dir),
        eos_token_ids=(tokenizer.token_to_id("<|im_end|>"),),
        device="cpu",
        has_draft_model=False,
        max_k=4,
    )
    checker = MaskServiceGrammarChecker(
        (f"127.0.0.1:{service.port}",),
        tokenizer_id=info.tokenizer_id,
        vocab_size=info.vocab_size,
        deadline_s=10.0,
        max_retries=1,
    )
    yield RequestValidator(tokenizer, info, checker, ServingDefaults(max_tokens=32, k=4), renderer)
    checker.close()
    service.stop(grace_s=1.0)


def _chat(*messages: tuple[str, str], instruction: str | None = None) -> ChatPrompt:
    return ChatPrompt(tuple(ChatMessage(r, c) for r, c in messages), instruction)


def test_renders_with_the_models_template(renderer: ChatRenderer, tokenizer) -> None:
    text = renderer.render(_chat(("user", "hi")), None)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")  # special tokens stay whole
    assert ids.count(tokenizer.token_to_id("<|im_end|>")) == 1


def test_schema_instruction_is_opt_in(renderer: ChatRenderer) -> None:
    """By default the caller's messages are the prompt; the instruction comes with "default" (or a
    server started with it), is merged, overridden, and only ever added for JSON Schema grammars."""
    plain = "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.render(_chat(("user", "go")), SCHEMA_SPEC) == plain
    system = DEFAULT_SCHEMA_INSTRUCTION.replace("{schema}", COMPACT)
    text = renderer.render(_chat(("user", "a user please"), instruction="default"), SCHEMA_SPEC)
    assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\na user please")
    server_default = ChatRenderer(renderer._prompter, DEFAULT_SCHEMA_INSTRUCTION)
    assert server_default.render(_chat(("user", "a user please")), SCHEMA_SPEC) == text
    # A caller's own system message is kept, after the instruction, in the one system turn.
    merged = server_default.render(_chat(("system", "Be terse."), ("user", "go")), SCHEMA_SPEC)
    assert merged.count("<|im_start|>system") == 1 and f"{system}\n\nBe terse.<|im_end|>" in merged
    # Overridden ("{schema}" substituted) and switched off ("") even where the server adds one.
    custom = renderer.render(_chat(("user", "go"), instruction="Schema={schema}"), SCHEMA_SPEC)
    assert custom.startswith(f"<|im_start|>system\nSchema={COMPACT}<|im_end|>")
    assert server_default.render(_chat(("user", "go"), instruction=""), SCHEMA_SPEC) == plain
    assert server_default.render(_chat(("user", "go")), SCHEMA_SPEC, instruction=False) == plain
    # Other grammar kinds get no instruction.
    regex = server_default.render(_chat(("user", "go")), GrammarSpec(GrammarKind.REGEX, "[a-z]+"))
    assert "system" not in regex


def test_an_instruction_too_long_for_the_context_is_left_out(validator: RequestValidator, renderer, tokenizer) -> None:
    """The instruction is the server's text: a schema whose instruction would not fit the context
    is rendered without it instead of getting the request refused for a prompt the caller did not send."""
    big = {"type": "object", "description": "lorem ipsum " * 4000}
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(big))
    chat = _chat(("user", "Give me an object."), instruction="default")
    assert len(tokenizer.encode(renderer.render(chat, spec)).ids) > 4096  # would be refused if kept
    seq = validator.validate(GenerationRequest(request_id="big", prompt=chat, grammar=spec))
    assert list(seq.prompt_token_ids) == tokenizer.encode(renderer.render(chat, spec, instruction=False)).ids
    # A schema that fits keeps its instruction.
    fits = validator.validate(GenerationRequest(request_id="fits", prompt=chat, grammar=SCHEMA_SPEC))
    assert list(fits.prompt_token_ids) == tokenizer.encode(renderer.render(chat, SCHEMA_SPEC)).ids


@pytest.mark.parametrize(
    ("chat", "needle"),
    [
        (_chat(), "no messages"),
        (_chat(("wizard", "x")), "role must be one of"),
    ],
)
def test_bad_conversations(renderer: ChatRenderer, chat: ChatPrompt, needle: str) -> None:
    with pytest.raises(ChatError, match=needle):
        renderer.render(chat, None)


def test_validator_tokenizes_the_rendered_chat(validator: RequestValidator, renderer, tokenizer) -> None:
    chat = _chat(("user", "Give me a name."))
    seq = validator.validate(GenerationRequest(request_id="c1", prompt=chat, grammar=SCHEMA_SPEC))
    assert list(seq.prompt_token_ids) == tokenizer.encode(renderer.render(chat, SCHEMA_SPEC)).ids
    assert seq.grammar == dataclasses.replace(SCHEMA_SPEC, checked=True)  # the server's default fallback
    assert seq.speculation.proposers == ("grammar_forced", "ngram")  # no draft model: the free drafts
    with pytest.raises(InvalidRequest, match="role must be one of"):
        validator.validate(GenerationRequest(request_id="c2", prompt=_chat(("robot", "x"))))


def test_validator_without_a_renderer_refuses_chat(tokenizer) -> None:
    info = WorkerInfo(
        vocab_size=tokenizer.get_vocab_size(),
        max_model_len=64,
        tokenizer_id="t",
        eos_token_ids=(0,),
        device="cpu",
        has_draft_model=False,
        max_k=4,
    )
    plain = RequestValidator(tokenizer, info, grammar_checker=None, defaults=ServingDefaults(32, 4))  # type: ignore[arg-type]  # no grammar here
    with pytest.raises(InvalidRequest, match="does not take chat prompts"):
        plain.validate(GenerationRequest(request_id="c3", prompt=_chat(("user", "x"))))


def test_proto_round_trip() -> None:
    for chat in (_chat(("system", "s"), ("user", "u")), _chat(("user", "u"), instruction="")):
        req = GenerationRequest(request_id="r", prompt=chat, grammar=SCHEMA_SPEC)
        back = request_from_proto(request_to_proto(req), "r")
        assert back.prompt == chat
