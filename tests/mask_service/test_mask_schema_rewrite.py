"""JSON Schemas xgrammar 0.2.8 compiles but does not enforce: refused, or rewritten so they are.

Refused schemas must give INVALID_ARGUMENT over gRPC with a message naming the
problem. Rewritten schemas are walked with a GrammarMatcher picking random
allowed tokens (fixed seeds): every completed output must be JSON that
validates against the *original* schema, and no token holding a raw control
character may ever be allowed (the grammars use compact separators, so no
whitespace token is legal anywhere either).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import numpy as np
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends import XGrammarBackend
from specmask.mask_service.grammar.json_regex import json_safe_pattern
from specmask.mask_service.grammar.schema_rewrite import FORMAT_PATTERNS, needs_ebnf_repair, repair_ebnf, rewrite_schema
from tests.mask_service.service_config import open_session_retrying

DATA = Path(__file__).resolve().parents[1] / "data" / "maskbench"
_ALLOF_NOTYPE = json.loads((DATA / "Handwritten---test.NoType.json").read_text())["schema"]

REFUSED: list[tuple[Any, str]] = [
    (_ALLOF_NOTYPE, "allOf"),
    # One branch next to other keywords: xgrammar keeps the branch and drops the rest.
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "allOf": [{"required": ["b"]}]},
        "allOf",
    ),
    # A format xgrammar enforces drops pattern/minLength/maxLength.
    ({"type": "string", "format": "email", "maxLength": 10}, "format"),
    ({"type": "object", "properties": {"t": {"type": "string", "format": "date-time", "pattern": "^2020"}}}, "format"),
    # Patterns that need '"', '\' or a control character, which can only be emitted raw.
    ({"type": "string", "pattern": '^a"b$'}, "pattern"),
    ({"type": "string", "pattern": "^[A-Z]:\\\\$"}, "pattern"),
    ({"type": "string", "pattern": "^\\t$"}, "pattern"),
    ({"type": "string", "pattern": "^[\\x00-\\x05]+$"}, "pattern"),
    ({"type": "object", "patternProperties": {"^\\n$": {"type": "integer"}}}, "pattern"),
    ({"type": "string", "pattern": "(?i)abc"}, "pattern"),
    ({"type": "string", "pattern": "\\bfoo"}, "pattern"),
    ({"type": "object", "patternProperties": {'^["a]$': {}, "^a$": {"type": "integer"}}}, "patternProperties"),
    # Validation keywords next to $ref/const/enum/anyOf/oneOf: xgrammar keeps only the first of those.
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "oneOf": [{"required": ["b"]}]},
        "oneOf",
    ),
    ({"$ref": "#/$defs/a", "maxLength": 3, "$defs": {"a": {"type": "string"}}}, "$ref"),
    ({"type": "string", "$ref": "#/$defs/n", "$defs": {"n": {"type": "integer"}}}, "$ref"),
    ({"type": "string", "anyOf": [{"$ref": "#/$defs/n"}], "$defs": {"n": {}}}, "anyOf"),
    # A type nothing next to it can have: unsatisfiable.
    ({"type": "object", "enum": ["a", "b"]}, "unsatisfiable"),
    ({"type": "integer", "anyOf": [{"type": "string"}, {"enum": ["x", 1.5]}]}, "unsatisfiable"),
    # required names not in properties, where adding them is not the same constraint.
    ({"type": "object", "additionalProperties": False, "required": ["a"]}, "unsatisfiable"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "required": ["a"]}, "required"),
    ({"type": "object", "propertyNames": {"maxLength": 3}, "required": ["a"]}, "required"),
]

# xgrammar refuses these itself (schema_check), and the service serves them on xgrammar after
# exact_rewrites merges the allOf, distributes the keywords beside anyOf into its branch or
# filters the enum.
MERGED: list[tuple[Any, str]] = [
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"maxLength": 3}]}}}, "allOf"),
    (
        {
            "$defs": {"d": {"allOf": [{"type": "string"}, {"type": "string"}]}},
            "type": "array",
            "items": {"$ref": "#/$defs/d"},
        },
        "allOf",
    ),
    ({"type": "array", "items": {"allOf": [{"type": "object"}, {"required": ["x"]}]}}, "allOf"),
    ({"type": "integer", "allOf": [{"minimum": 5}]}, "allOf"),
    ({"type": "integer", "minimum": 0, "anyOf": [{"maximum": 5}]}, "anyOf"),
    # Scalar values beside other keywords: the enum filter keeps the ones that pass.
    ({"enum": ["a", "bb"], "maxLength": 1}, "enum"),
    ({"const": "x", "enum": ["x", "y"]}, "const"),
]

# Accepted and enforced (some after a rewrite). Every one is walked.
ACCEPTED: list[Any] = [
    {"type": "string"},
    {"type": "string", "minLength": 1},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "maxLength": 2},
    {"type": ["string", "null"], "minLength": 1, "maxLength": 3},
    {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 1, "maxLength": 4},
            "b": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 3},
        },
        "required": ["a", "b"],
    },
    {"type": "object", "additionalProperties": {"type": "string", "minLength": 1, "maxLength": 3}, "maxProperties": 2},
    {
        "type": "object",
        "propertyNames": {"maxLength": 3},
        "maxProperties": 2,
        "additionalProperties": {"type": "integer"},
    },
    # No type: xgrammar would allow any value and ignore these keywords.
    {
        "type": "object",
        "properties": {"s": {"minLength": 2, "maxLength": 4}, "n": {"minimum": 3, "maximum": 9}},
        "required": ["s", "n"],
    },
    {"pattern": "^[a-c]{1,3}$"},
    # Patterns: sanitised classes, small and large automata (the large one is compiled raw by xgrammar).
    {"type": "string", "pattern": "^.{1,5}$"},
    {"type": "string", "pattern": "^\\S+$"},
    {"type": "string", "pattern": "^[^a]{2,4}$"},
    {"type": "string", "pattern": "^[ -~]{0,1200}$"},
    {"type": "string", "pattern": "^.{0,20000}$"},
    {"type": "string", "pattern": "^[\\s\\S]{1,10000}$"},
    {"type": "string", "pattern": "^(?:\\w|\\W){1,6}$"},
    {"type": "string", "pattern": "^[\\w.-]+@x\\.com$"},
    {"type": "object", "patternProperties": {"^k.*$": {"type": "integer"}}, "maxProperties": 2},
    # Formats: rewritten (email, json pointers) and kept (the others are JSON-safe).
    {"type": "string", "format": "email"},
    {"type": "string", "format": "json-pointer"},
    {"type": "string", "format": "relative-json-pointer"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uri"},
    {"type": "string", "format": "uri-template"},
    # Data with control characters, quotes and backslashes is escaped by xgrammar.
    {"enum": ["a\u0001b", 'x"y\\z', "\n", "é"]},
    {"type": "object", "properties": {"c": {"const": "tab\there \u001f"}}, "required": ["c"]},
    # allOf with one subschema and no siblings is enforced.
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]}]},
    {"type": "object", "properties": {"v": {"allOf": [{"type": "string", "maxLength": 3}]}}, "required": ["v"]},
    # required names missing from properties: added with the additionalProperties schema.
    {"type": "object", "required": ["a"]},
    {
        "type": "object",
        "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}},
        "additionalProperties": {"type": "string", "maxLength": 3},
    },
    # No type, only object keywords: becomes an object.
    {"required": ["k"]},
    # type next to anyOf/oneOf/enum/const/$ref: redundant, pushed into the branches, or filtering the enum.
    {
        "type": "integer",
        "anyOf": [
            {"minimum": 0, "maximum": 5},
            {"type": "number", "minimum": 100, "maximum": 105},
            {"type": "string"},
            {"enum": [7, "x", 8.5]},
        ],
    },
    {"type": ["string", "null"], "oneOf": [{"type": "string", "maxLength": 2}, {"type": "null"}]},
    {"type": "string", "oneOf": [{"maxLength": 1}, {"minLength": 3, "maxLength": 4}]},
    {"type": "string", "enum": ["a", 1, "b", None]},
    {"type": "integer", "const": 3},
    {
        "type": "object",
        "$ref": "#/$defs/o",
        "$defs": {"o": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    },
]
WALKS = 30
MAX_STEPS = 120


def _spec(schema: Any) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))


@pytest.mark.parametrize("schema,word", REFUSED, ids=[f"refused{i}" for i in range(len(REFUSED))])
def test_refused_over_grpc(client: MaskServiceClient, bpe_id: str, schema: Any, word: str) -> None:
    # xgrammar's refusals (a spec left to the service may go to llguidance, which enforces
    # some of these: tests/mask_service/test_llguidance_backend.py checks those).
    with pytest.raises(MaskServiceError) as exc:
        client.open_session(bpe_id, GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), backend="xgrammar"))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # A schema no value satisfies is refused before any engine (unsatisfiable.py), in its own words.
    said = "matches nothing" in exc.value.message or "unsupported" in exc.value.message
    assert said and word in exc.value.message, exc.value.message


@pytest.mark.parametrize("schema,word", MERGED, ids=[f"merged{i}" for i in range(len(MERGED))])
def test_merged_served_on_xgrammar(
    client: MaskServiceClient, registry: Any, bpe_id: str, schema: Any, word: str
) -> None:
    """The engine alone still refuses the keyword; the service, which rewrites first, serves it."""
    compiler = XGrammarBackend.make_compiler(registry.info(bpe_id, None), 1)
    with pytest.raises(GrammarError, match=word):
        XGrammarBackend().compile(compiler, _spec(schema))
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), backend="xgrammar")
    client.close_session(open_session_retrying(client, bpe_id, spec))


def test_accepted_over_grpc(client: MaskServiceClient, bpe_id: str) -> None:
    for schema in ACCEPTED:
        client.close_session(open_session_retrying(client, bpe_id, _spec(schema)))


class _Walker:
    """Random walks of a compiled grammar over one tokenizer."""

    def __init__(self, info: Any) -> None:
        import xgrammar as xgr

        self.info = info
        self.compiler = XGrammarBackend.make_compiler(info, 1)
        self.vocab = [bytes(t) for t in info.decoded_vocab]
        self.stops = set(info.stop_token_ids)
        self.ctrl = np.array(
            [any(b < 0x20 for b in t) and i not in self.stops for i, t in enumerate(self.vocab)]
            + [False] * (info.vocab_size - len(self.vocab))
        )
        assert self.ctrl.sum() >= 20, "the tokenizer must have raw control-character tokens for this test"
        # Tokens that tend to end a value (a '@' too, for emails): preferred more and more as a walk grows.
        self.closing = np.array(
            [any(c in t for c in b'"}]@') for t in self.vocab] + [False] * (info.vocab_size - len(self.vocab))
        )
        self.bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema: Any) -> Any:
        return XGrammarBackend().compile(self.compiler, _spec(schema))

    def allowed(self, matcher: Any) -> np.ndarray:
        matcher.fill_next_token_bitmask(self.bitmask)
        words = self.bitmask.numpy()[0].view(np.uint8)
        return np.unpackbits(words, bitorder="little")[: self.info.vocab_size].astype(bool)

    def walk(self, compiled: Any, rng: random.Random) -> bytes | None:
        """One random walk; the output bytes if the grammar completed, None if cut off."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        out = b""
        for step in range(MAX_STEPS):
            allowed = self.allowed(matcher)
            bad = np.nonzero(allowed & self.ctrl)[0]
            assert not bad.size, f"after {out!r}: control-character tokens allowed: {[self.vocab[i] for i in bad[:5]]}"
            ids = np.nonzero(allowed)[0]
            assert ids.size, f"dead end after {out!r}"
            stops = [i for i in ids if i in self.stops]
            if stops and rng.random() < 0.5:
                return out
            closing = ids[self.closing[ids]]
            pool = closing if closing.size and rng.random() < min(0.9, 0.3 + step / 20) else ids
            tok = int(pool[rng.randrange(pool.size)])
            if tok in self.stops:
                return out
            assert matcher.accept_token(tok)
            out += self.vocab[tok]
        return None


def _check_walks(walker: _Walker, schema: Any, seed: int, walks: int = WALKS) -> int:
    compiled = walker.compile(schema)
    rng = random.Random(seed)
    checker = jsonschema.FormatChecker()
    completed = 0
    for _ in range(walks):
        out = walker.walk(compiled, rng)
        if out is None:
            continue
        text = out.decode("utf-8")
        value = json.loads(text)  # raises on invalid JSON
        jsonschema.validate(value, schema, format_checker=checker)
        completed += 1
    return completed


@pytest.fixture(scope="module")
def bpe_walker(registry, bpe_id: str) -> _Walker:
    return _Walker(registry.info(bpe_id, None))


@pytest.mark.parametrize("index", range(len(ACCEPTED)))
def test_rewritten_outputs_validate(bpe_walker: _Walker, index: int) -> None:
    schema = ACCEPTED[index]
    completed = _check_walks(bpe_walker, schema, seed=index)
    assert completed >= WALKS // 3, f"only {completed}/{WALKS} walks completed for {schema}"


def test_length_strings_admit_no_control_characters(bpe_walker: _Walker) -> None:
    """The case seen in production: minLength strings emitted \\x00 and \\x11."""
    import xgrammar as xgr

    for schema in ({"type": "string", "minLength": 1}, {"type": "string", "maxLength": 64}):
        matcher = xgr.GrammarMatcher(bpe_walker.compile(schema))
        assert matcher.accept_string(b'"')
        allowed = bpe_walker.allowed(matcher)
        assert not (allowed & bpe_walker.ctrl).any()
        for raw in (b"\x00", b"\x11", b"\t", b"\x1f"):
            assert not xgr.GrammarMatcher(bpe_walker.compile(schema)).accept_string(b'"' + raw), raw
        # Length is counted in code points.
        m = xgr.GrammarMatcher(bpe_walker.compile({"type": "string", "maxLength": 2}))
        assert m.accept_string('"é😀"'.encode())
        assert not xgr.GrammarMatcher(bpe_walker.compile({"type": "string", "maxLength": 2})).accept_string(
            '"é😀a'.encode()
        )


def test_rewritten_formats_reject_raw_and_invalid_escapes(bpe_walker: _Walker) -> None:
    """xgrammar's own email allows a quoted local part with any escape (\\a: invalid JSON);
    json-pointer allows raw controls."""
    import xgrammar as xgr

    cases = [
        ("email", b'"\\"\\a\\"@b.co"', b'"a.b@c.io"'),
        ("json-pointer", b'"/\x01"', b'"/a~1b/0"'),
        ("relative-json-pointer", b'"0/\\"', b'"1#"'),
    ]
    for fmt, bad, good in cases:
        compiled = bpe_walker.compile({"type": "string", "format": fmt})
        assert not xgr.GrammarMatcher(compiled).accept_string(bad), fmt
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(good) and m.accept_token(next(iter(bpe_walker.stops))), fmt


def test_xgrammar_still_prints_the_repaired_class() -> None:
    """Guards the EBNF repair against an xgrammar upgrade changing its output."""
    import xgrammar as xgr

    g = xgr.Grammar.from_json_schema(
        json.dumps({"type": "string", "minLength": 1}), any_whitespace=False, separators=(",", ":"), strict_mode=True
    )
    ebnf = str(g)
    assert needs_ebnf_repair(ebnf)
    repaired = repair_ebnf(ebnf)
    assert not needs_ebnf_repair(repaired)
    assert str(xgr.Grammar.from_ebnf(repaired)).count("\\0-\\x1f") >= 2
    # No rewrite: a schema without length-limited strings compiles from xgrammar's own grammar.
    assert not needs_ebnf_repair(str(xgr.Grammar.from_json_schema(json.dumps({"type": "string"}))))


def test_rewrite_schema_shapes() -> None:
    original = {
        "type": "object",
        "properties": {
            "e": {"type": "string", "format": "email"},
            "n": {"minimum": 1},
            "s": {"maxLength": 2, "enum": ["a"]},
        },
        "patternProperties": {"^x.$": {}},
    }
    before = json.dumps(original)
    out = rewrite_schema(original)
    assert json.dumps(original) == before  # input untouched
    assert out["properties"]["e"] == {"type": "string", "pattern": json_safe_pattern(FORMAT_PATTERNS["email"], "#")}
    assert out["properties"]["n"]["type"] == "number"
    assert "type" not in out["properties"]["s"]  # enum: xgrammar enforces it, nothing to add
    assert list(out["patternProperties"]) == [json_safe_pattern("^x.$", "#")]
    # Data is never rewritten.
    data = {"const": {"minLength": 1, "pattern": "\\t"}, "examples": [{"pattern": "\\t"}]}
    assert rewrite_schema(data) == data


def test_rewrite_type_and_required_shapes() -> None:
    out = rewrite_schema(
        {
            "type": "integer",
            "anyOf": [
                {"minimum": 0},
                {"type": ["number", "string"]},
                {"type": "string"},
                {"enum": [1, "a"]},
                {"const": 2.5},
                False,
            ],
        }
    )
    assert out == {"anyOf": [{"minimum": 0, "type": "integer"}, {"type": "integer"}, {"enum": [1]}]}
    assert rewrite_schema({"type": "string", "enum": ["a", 1]}) == {"type": "string", "enum": ["a"]}
    assert rewrite_schema({"required": ["a"]}) == {"required": ["a"], "type": "object", "properties": {"a": {}}}
    assert rewrite_schema({"minItems": 1})["type"] == "array"
    out = rewrite_schema(
        {"type": "object", "properties": {"b": {}}, "required": ["a", "b"], "additionalProperties": {"type": "integer"}}
    )
    assert out["properties"] == {"b": {}, "a": {"type": "integer"}}
    # A non-object type makes required vacuous: nothing added.
    assert "properties" not in rewrite_schema({"type": "string", "required": ["a"]})


def test_ecma_class_dash() -> None:
    # ECMA-262 reads '-' next to a class escape literally; Python's parser rejects it.
    assert json_safe_pattern("^[\\w-.]+$", "#") == json_safe_pattern("^[\\w.\\-]+$", "#")
    assert json_safe_pattern("[a-\\d]", "#") == json_safe_pattern("[a\\-\\d]", "#")


# Atoms whose JSON-safe version is checked character by character against Python's re.
_ATOMS = [
    ".",
    "\\S",
    "\\s",
    "\\d",
    "\\D",
    "\\w",
    "\\W",
    "[^a\\s]",
    "[\\s\\S]",
    "[ -~]",
    '["a]',
    "[^\\d,]",
    "[\\x00-\\x7f]",
    '[^"]',
]
_SAMPLE = [c for c in range(0x3100) if not 0xD800 <= c <= 0xDFFF] + list(range(0x3100, 0x110000, 97))


@pytest.mark.parametrize("atom", _ATOMS)
def test_safe_atoms_are_subsets(atom: str) -> None:
    # Python's re spells the astral escape \U0001f600 where ECMA-262 (and xgrammar) use \u{1f600}.
    py = re.sub(r"\\u\{([0-9a-f]+)\}", lambda m: f"\\U{int(m.group(1), 16):08x}", json_safe_pattern(f"^{atom}$", "#"))
    safe = re.compile(py)
    orig = re.compile(f"^{atom}$")
    matched = 0
    for c in _SAMPLE:
        ch = chr(c)
        if safe.fullmatch(ch):
            matched += 1
            assert orig.fullmatch(ch), (atom, hex(c))
            assert c >= 0x20 and ch not in '"\\', (atom, hex(c))
    assert matched


@pytest.mark.shared_data
def test_gpt2_sanity(shared_data: Path) -> None:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tok_dir = shared_data / "tokenizers" / "gpt2"
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.skip("gpt2 tokenizer not in shared data")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    walker = _Walker(xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos]))
    for i, schema in enumerate(
        [
            {"type": "string", "minLength": 1, "maxLength": 8},
            {"type": "string", "format": "email"},
            {"type": "object", "properties": {"k": {"type": "string", "pattern": "^.{1,6}$"}}, "required": ["k"]},
        ]
    ):
        assert _check_walks(walker, schema, seed=100 + i, walks=10) >= 3
