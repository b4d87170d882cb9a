"""Request bodies of the OpenAI API, as pydantic models (parsing and shape checks only).

Unknown fields are kept aside (``extra="allow"``) and ignored, as vLLM does:
``lenient`` logs each new name once and counts them. Fields OpenAI defines that this
server does not implement (``n > 1``, penalties, ``logit_bias``)
are declared so they can be refused with a precise message in ``translate``,
while their neutral values (``n=1``, penalties 0) pass.

Extensions (named after vLLM's ``extra_body`` fields where one exists):
``top_k``, ``ignore_eos``, ``guided_json``, ``guided_regex``, ``guided_grammar``
(EBNF), ``guided_lark``, ``guided_choice``, ``guided_decoding_backend``, and ours:
``guided_checked`` / ``guided_max_attempts`` (checked mode), ``speculation``
(``enabled``, ``k``, ``proposers``, ``draft_masking``) and, for chat,
``schema_instruction``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Text parts only: images/audio are refused by the part's ``type`` literal.
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool results
    refusal: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute: stored as ``schema_``, read and written as "schema".
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # newer SDKs send it; there is nothing to obfuscate


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``), field for field.

    One constraint (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
    ``structural_tag``) per request. Every key is a constraint or changes one, so a key
    this server does not know is a 400 (``extra="forbid"``), never ignored; the options it
    knows but cannot honour are refused in ``translate``.
    """

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")  # shadows BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark, as vLLM accepts either
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class Speculation(_Body):
    """Extension: per-request speculation (the gRPC API's SpeculationParams)."""

    enabled: bool = True
    k: int | None = None
    proposers: list[str] | None = None  # "draft_model", "grammar_forced", "ngram"
    draft_masking: bool = True


class _Generation(_Body):
    """Fields both endpoints share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions.
    top_k: int | None = None
    min_p: float | None = None  # vLLM's: [0, 1], 0 = off
    min_tokens: int | None = None  # vLLM's: no EOS / stop_token_ids / stop string before this many tokens
    ignore_eos: bool | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None  # EBNF (xgrammar / GBNF dialect)
    guided_lark: str | None = None
    guided_choice: list[str] | None = None
    speculation: Speculation | None = None
    # Grammar engine, named like vLLM's field: "auto" (the service picks), "xgrammar", "llguidance"
    # ("guidance", vLLM's name for llguidance, is taken too). Checked mode: ``guided_checked``
    # true / false / unset (the server's --grammar-fallback) + optional ``guided_max_attempts``.
    # All three need an output constraint.
    guided_decoding_backend: str | None = None
    guided_checked: bool | None = None
    guided_max_attempts: int | None = None
    # vLLM's structured outputs (its replacement of the guided_* fields).
    structured_outputs: StructuredOutputs | None = None
    # vLLM's stop extensions: generation ends when one of these token ids is sampled
    # (the token counts in usage; its text is returned only with include_stop_str_in_output).
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extension: the system instruction a JSON Schema request's chat gets (specmask/orchestrator/chat.py);
    # None = the server's default (none unless started with --schema-instruction), "" = none,
    # "default" = the built-in instruction, else this text ("{schema}" becomes the schema).
    schema_instruction: str | None = None
    # vLLM: extra variables for the chat template (Jinja ignores the ones it does not read);
    # reasoning_effort is passed to the template too, as vLLM does.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # Extension, with --reasoning-parser and an output constraint: after this many tokens of
    # thinking only the end of the thinking may follow (orchestrator/reasoning.py).
    max_reasoning_tokens: int | None = None
    # Accepted and ignored: they change nothing about generation.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # extension: the chat API's structured outputs
