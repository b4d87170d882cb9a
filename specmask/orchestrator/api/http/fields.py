"""Every request field vLLM's OpenAI server knows, and what this server does with it.

One table (``FIELDS``) is the source of truth for the HTTP API's request fields:

* ``SUPPORTED``: honoured with vLLM's meaning (declared in ``protocol``, translated in ``translate``);
* ``REFUSED``: a 400 naming the field (``param``) unless the value is one of the rule's
  neutral values, which change nothing (``repetition_penalty: 1.0``);
* ``NO_EFFECT``: accepted; it cannot change what is generated here (``metadata``,
  ``cache_salt``, ``kv_transfer_params`` without disaggregated serving).

A field outside the table is unknown and ignored (``lenient``): OpenAI's SDKs and frameworks
add fields every release. That leniency is only safe because every field vLLM's request
models declare is in the table (tests/orchestrator/api/http/test_http_fields.py walks vLLM's
field names, committed from its source), so a vLLM field that changes the output can never
fall through to "ignored". The table in docs/openai-api.md is generated from this one
(``markdown_table``) and checked against it by the same test.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from specmask.orchestrator.api.http.errors import ApiError


class Support(enum.Enum):
    SUPPORTED = "supported"
    REFUSED = "400"
    NO_EFFECT = "accepted, no effect"


@dataclass(frozen=True)
class FieldRule:
    support: Support
    meaning: str  # what the field means to vLLM (or OpenAI, for its own fields)
    here: str = ""  # what SpecMask does with it, when the support class alone does not say
    # REFUSED: values that change nothing and pass (None, the absent value, always passes).
    neutral: tuple[Any, ...] = ()


def _s(meaning: str, here: str = "") -> FieldRule:
    return FieldRule(Support.SUPPORTED, meaning, here)


def _r(meaning: str, *neutral: Any, here: str = "") -> FieldRule:
    return FieldRule(Support.REFUSED, meaning, here, neutral)


def _n(meaning: str, here: str = "") -> FieldRule:
    return FieldRule(Support.NO_EFFECT, meaning, here)


FIELDS: Mapping[str, FieldRule] = {
    # OpenAI's fields.
    "model": _s("the model to use", "must name the served model"),
    "messages": _s("the conversation (chat)", "text content and text parts; images and audio are a 400"),
    "prompt": _s("the prompt (completions): text, or token ids", "one prompt per request; a batch is a 400"),
    "max_tokens": _s("cap on output tokens"),
    "max_completion_tokens": _s("cap on output tokens (chat)"),
    "temperature": _s("sampling temperature (default 1)"),
    "top_p": _s("nucleus sampling"),
    "seed": _s("the sampling seed", "must be >= 0"),
    "stop": _s("stop strings; the output ends before the first", "under a grammar: only where the grammar may end"),
    "stream": _s("server-sent events"),
    "stream_options": _s("`include_usage`: a last chunk with usage"),
    "response_format": _s("`json_object`, `json_schema` (OpenAI); `structural_tag` (vLLM)", "structural_tag is a 400"),
    "tools": _s("functions the model may call"),
    "tool_choice": _s("`none`, `auto`, `required` or a named function"),
    "parallel_tool_calls": _s("more than one call per answer"),
    "logprobs": _s("token logprobs (chat: bool; completions: 0..5)"),
    "top_logprobs": _s("alternatives per token (chat: 0..20)"),
    "n": _r("choices per request", 1, here="only 1"),
    "presence_penalty": _r("penalty on tokens already in the output", 0, here="only 0"),
    "frequency_penalty": _r("penalty by count of tokens in the output", 0, here="only 0"),
    "logit_bias": _r("additive bias per token id", {}, here="only {}"),
    "user": _n("an end-user id"),
    "metadata": _n("key-value tags stored with the request"),
    "store": _n("store the completion for distillation"),
    "service_tier": _n("OpenAI's processing tier"),
    "echo": _r("completions: return the prompt before the output; chat: prepend the last message", False),
    "suffix": _r("completions: text after the insertion point", "", here="only empty"),
    "best_of": _r("completions: server-side candidates, the best returned", 1, here="only 1"),
    "reasoning_effort": _s("passed to the chat template (reasoning models)", "a template variable, as in vLLM"),
    "include_reasoning": _n(
        "return the reasoning parser's output", "with --reasoning-parser the reasoning is always returned apart"
    ),
    "max_reasoning_tokens": _s(
        "a cap on the reasoning section's tokens (SpecMask)",
        "chat, with --reasoning-parser and an output constraint: then the section's end is forced",
    ),
    # vLLM's sampling extensions.
    "use_beam_search": _r("beam search instead of sampling", False),
    "top_k": _s("top-k sampling (0: off)"),
    "min_p": _s("drop tokens below min_p x the most likely token's probability"),
    "repetition_penalty": _r("penalty on tokens in the prompt and output (1: off)", 1, here="only 1"),
    "length_penalty": _n("beam search's length penalty", "beam search is refused"),
    "stop_token_ids": _s("token ids that end generation when sampled", "under a grammar: only where it may end"),
    "include_stop_str_in_output": _s("return the stop string (or stop token's text) with the output"),
    "ignore_eos": _s("keep generating past end-of-sequence"),
    "min_tokens": _s("no EOS, stop token or stop string (one ending in them) ends the output within this many tokens"),
    "skip_special_tokens": _r("drop special tokens from the text", True, here="only true"),
    "spaces_between_special_tokens": _r("spaces between special tokens in the text", True, here="only true"),
    "truncate_prompt_tokens": _r("keep only the prompt's last N tokens", here="a prompt too long is a 400"),
    "prompt_logprobs": _r("logprobs of the prompt tokens"),
    "allowed_token_ids": _r("sample only from these token ids"),
    "bad_words": _r("words the output may not contain", []),
    # vLLM's other extensions.
    "add_generation_prompt": _r("the chat template's assistant header", True, here="only true"),
    "continue_final_message": _r("continue the last (assistant) message instead of a new one", False),
    "add_special_tokens": _r("add BOS etc. to the prompt", True, here="the tokenizer's special tokens are added"),
    "documents": _r("RAG documents for the chat template"),
    "chat_template": _r("a Jinja chat template for this request", here="the model's own template only"),
    "chat_template_kwargs": _s("extra chat template variables", "unread variables are ignored, as by Jinja"),
    "mm_processor_kwargs": _n("multimodal processor options", "no multimodal input here"),
    "structured_outputs": _s("vLLM's output constraints (table below)"),
    "priority": _r("scheduling priority", 0, here="only 0"),
    "request_id": _n("vLLM's request id", "SpecMask's request id is the X-Request-Id header"),
    "logits_processors": _r("custom logits processors"),
    "return_tokens_as_token_ids": _r("logprob tokens as `token_id:N`", False),
    "return_token_ids": _r("return token ids with the text", False),
    "cache_salt": _n("salt for the prefix cache", "no cross-request prefix cache here"),
    "kv_transfer_params": _n("disaggregated prefill/decode", "no KV transfer here"),
    "vllm_xargs": _n("arguments for custom vLLM extensions", "no such extensions here"),
    "max_repetition_pattern_size": _r("stop on a repeated token pattern up to this size", 0),
    "min_repetition_pattern_size": _r("stop on a repeated token pattern from this size", 0),
    "repetition_min_count": _r("repetitions that stop a repeated pattern", 0),
    "prompt_embeds": _r("prompt embeddings instead of text"),
    # vLLM's older guided_* fields (removed in v0.12) and SpecMask's own.
    "guided_json": _s("JSON Schema constraint (older vLLM)"),
    "guided_regex": _s("regular expression constraint (older vLLM)"),
    "guided_grammar": _s("EBNF grammar constraint (older vLLM)"),
    "guided_choice": _s("one of these strings (older vLLM)"),
    "guided_decoding_backend": _s("grammar engine: auto, xgrammar, llguidance (guidance)"),
    "guided_whitespace_pattern": _r("whitespace allowed in JSON (older vLLM)", here="JSON whitespace is the engine's"),
    "guided_lark": _s("Lark grammar constraint (SpecMask)"),
    "guided_checked": _s("checked mode: a relaxed grammar plus the end check (SpecMask)"),
    "guided_max_attempts": _s("checked mode's attempts (SpecMask)"),
    "speculation": _s("per-request speculation (SpecMask)"),
    "schema_instruction": _s("the JSON Schema instruction of a chat (SpecMask)"),
    # Fields of other APIs that change the output.
    "functions": _r("OpenAI's legacy functions", here="send tools"),
    "function_call": _r("OpenAI's legacy function choice", here="send tool_choice"),
    "thinking": _r("a thinking switch (other APIs)", here="send chat_template_kwargs, e.g. enable_thinking"),
}

# ``structured_outputs``: vLLM's ``StructuredOutputsParams`` fields (unknown keys are a 400).
STRUCTURED_OUTPUTS: Mapping[str, FieldRule] = {
    "json": _s("a JSON Schema (object or JSON text)"),
    "regex": _s("a regular expression the whole output matches"),
    "choice": _s("exactly one of these strings"),
    "grammar": _s("a context-free grammar, EBNF (GBNF) or Lark", "Lark when it has `start:`, else EBNF"),
    "json_object": _s("any JSON object"),
    "structural_tag": _r("tagged regions with their own schemas"),
    # Both values of these two are honoured: generated JSON never holds whitespace between
    # tokens, and objects get no properties their schema does not name (xgrammar's strict
    # mode), a subset of what either value allows.
    "disable_any_whitespace": _s("no whitespace in generated JSON", "JSON is always generated compact"),
    "disable_additional_properties": _s(
        "objects without additionalProperties get false", "always so (xgrammar's strict mode)"
    ),
    "whitespace_pattern": _r("the whitespace generated JSON may hold"),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """None, or equal to a neutral value of the same kind (``True`` is not ``1``)."""
    if value is None:
        return True
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def refuse(name: str, rule: FieldRule, prefix: str = "") -> ApiError:
    allowed = " (" + rule.here + ")" if rule.here else ""
    return ApiError.invalid(f"{prefix}{name} is not supported{allowed}: {rule.meaning}", param=prefix + name)


def check_undeclared(body: BaseModel) -> None:
    """Refuse the table's fields that this endpoint's request model does not declare (declared
    ones are translated, or refused by ``translate`` with their own message): a REFUSED field
    unless neutral, and a SUPPORTED one too, as it is honoured on another endpoint only (``tools``
    sent to completions) or not by this build. Only NO_EFFECT and unknown fields pass."""
    for name, value in (body.model_extra or {}).items():
        rule = FIELDS.get(name)
        if rule is None or rule.support is Support.NO_EFFECT or value is None:
            continue
        if rule.support is Support.SUPPORTED:
            raise ApiError.invalid(f"{name} is not supported on this endpoint: {rule.meaning}", param=name)
        if not _is_neutral(value, rule.neutral):
            raise refuse(name, rule)


def check_structured_outputs(values: Mapping[str, Any]) -> None:
    """Refuse the ``structured_outputs`` options this server cannot honour exactly."""
    for name, value in values.items():
        rule = STRUCTURED_OUTPUTS[name]
        if rule.support is Support.REFUSED and not _is_neutral(value, rule.neutral):
            raise refuse(name, rule, prefix="structured_outputs.")


def markdown_table(rules: Mapping[str, FieldRule] = FIELDS) -> str:
    """The table docs/openai-api.md holds (checked by the test suite)."""
    rows = ["| field | meaning | SpecMask |", "|---|---|---|"]
    for name, rule in sorted(rules.items()):
        here = rule.support.value + (f": {rule.here}" if rule.here else "")
        rows.append(f"| `{name}` | {rule.meaning} | {here} |")
    return "\n".join(rows)
