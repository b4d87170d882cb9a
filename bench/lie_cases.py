"""Random grammars and requests for the lie hunter, and the independent output checks.

"Never lie" must hold for *any* input, so `bench.lies` and
tests/e2e/test_never_lie.py throw seeded random requests at the real stack and
check every completed output with code that shares nothing with the serving path
(no xgrammar, no orchestrator.output_check): ``jsonschema`` for JSON Schemas,
Python ``re.fullmatch`` for regular grammars, a small recursive recogniser for
the recursive grammars.

Generated from one ``random.Random(seed)``: the same seed gives the same cases.

* JSON Schemas mix types, enum/const, string bounds/patterns/formats, integer and
  number bounds, objects (required, additionalProperties absent/false/true/schema,
  patternProperties, min/maxProperties), arrays (items, prefixItems, min/maxItems),
  anyOf/oneOf/allOf and $ref into $defs, with every JSON option: strict on/off
  (``allow_additional_properties``), any_whitespace, separators. The *truth* schema
  the output is checked against is the caller's meaning of the request: with
  strict on, an object schema that lists properties (or patternProperties) and says
  nothing about additionalProperties allows no other keys, and prefixItems without
  items allows nothing after them (GrammarSpec.strict, docs/INTERFACES.md).
* Regular grammars come from one small AST rendered three ways: as a regex (sent as
  REGEX), as EBNF and as Lark; the check is ``re.fullmatch`` of the regex rendering.
  The AST uses only syntax on which xgrammar's and Python's regex dialects agree
  (alphanumeric literals, [a-z0-9] ranges, groups, |, ?, *, +, {m,n}).
* Recursive grammars (nested digit lists) in EBNF and Lark, checked by a recogniser.
* Sampling: temperature 0, denormals, the greedy floor's edges, 1, huge (100);
  top_p and top_k edges; seeded and unseeded. Speculation: off, k 0..max_k, every
  proposer subset, draft masking on/off.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

PROMPTS = ("Generate JSON for schema user:\n", "x", "Answer:", "{", "0 1 2", "The value is ")
WORDS = ("a", "b", "ok", "no", "yes", "red", "x1", "id", "n", "é", "日本", "q r")
NAMES = ("a", "b", "c", "id", "name", "ok", "v", "x_1", "tag", "n")
SEPARATORS = ((",", ":"), (", ", ": "), (",", ": "), (" , ", " : "))
TEMPERATURES = (0.0, 1e-45, 1e-40, 1e-38, 1e-30, 1e-6, 9.99e-6, 1e-5, 0.3, 0.7, 1.0, 1.5, 5.0, 100.0)
TOP_PS = (None, 1.0, 0.95, 0.5, 1e-3, 1e-9)
TOP_KS = (None, 0, 1, 2, 10, 50, 1 << 30)
PROPOSERS = (pb.PROPOSER_DRAFT_MODEL, pb.PROPOSER_GRAMMAR_FORCED, pb.PROPOSER_NGRAM)
FORMATS = ("date", "uuid", "ipv4", "time", "email")


@dataclass(frozen=True)
class Case:
    """One request and the independent check of a completed output."""

    name: str  # family, for reports
    request: pb.GenerateRequest
    check: Callable[[str], str | None]  # None if the text is a valid complete document, else why not
    description: str  # the grammar, for failure reports


# ---- independent checks -----------------------------------------------------


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys in {keys}")
    return dict(pairs)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')


def _format_problem(text: str, any_whitespace: bool, separators: tuple[str, str]) -> str | None:
    """Whitespace outside strings must come from the separators when any_whitespace is off."""
    if any_whitespace:
        return None
    outside = _STRING_LITERAL.sub('""', text)
    for sep in separators:
        outside = outside.replace(sep, sep.strip())
    if re.search(r"\s", outside):
        return f"whitespace outside the separators {separators!r}"
    return None


def json_check(truth: Any, any_whitespace: bool, separators: tuple[str, str]) -> Callable[[str], str | None]:
    validator_cls = jsonschema.validators.validator_for(truth, default=jsonschema.Draft202012Validator)
    validator = validator_cls(truth, format_checker=validator_cls.FORMAT_CHECKER)

    def check(text: str) -> str | None:
        try:
            doc = json.loads(text, object_pairs_hook=_pairs_no_duplicates, parse_constant=_reject_constant)
        except ValueError as exc:
            return f"not JSON: {exc}"
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            return f"schema: {errors[0].message}"
        return _format_problem(text, any_whitespace, separators)

    return check


def regex_check(pattern: str) -> Callable[[str], str | None]:
    compiled = re.compile(pattern, re.DOTALL)
    return lambda text: None if compiled.fullmatch(text) else f"re.fullmatch({pattern!r}) fails"


def nested_digits_check(text: str) -> str | None:
    """Language of the recursive grammars: v ::= "[" (v ("," v)*)? "]" | [0-9]."""
    pos = 0

    def value() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos].isdigit() and text[pos].isascii():
            pos += 1
            return True
        if pos >= len(text) or text[pos] != "[":
            return False
        pos += 1
        if pos < len(text) and text[pos] == "]":
            pos += 1
            return True
        while True:
            if not value():
                return False
            if pos < len(text) and text[pos] == ",":
                pos += 1
                continue
            if pos < len(text) and text[pos] == "]":
                pos += 1
                return True
            return False

    return None if value() and pos == len(text) else "not a nested digit list"


# ---- JSON Schemas -------------------------------------------------------------


class _SchemaGen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.defs: dict[str, Any] = {}

    def leaf(self) -> dict[str, Any]:
        r = self.rng
        choice = r.randrange(11)
        if choice == 0:
            return {"type": "boolean"}
        if choice == 1:
            return {"type": "null"}
        if choice == 2:
            lo = r.randint(-50, 50)
            out: dict[str, Any] = {"type": "integer", "minimum": lo, "maximum": lo + r.choice((0, 1, 9, 1000))}
            if r.random() < 0.3:
                out["exclusiveMinimum"] = lo - 1
            return out
        if choice == 3:
            return {"type": "number", "minimum": -5, "maximum": r.choice((5, 1e6))}
        if choice == 4:
            return {"enum": r.sample(WORDS, r.randint(1, 4))}
        if choice == 5:
            return {"enum": [r.choice(WORDS), r.randint(-3, 3), r.choice((True, False)), None][: r.randint(1, 4)]}
        if choice == 6:
            return {"const": r.choice((r.choice(WORDS), r.randint(0, 9), True, None))}
        if choice == 7:
            lo = r.randint(0, 3)
            return {"type": "string", "minLength": lo, "maxLength": lo + r.randint(0, 4)}
        if choice == 8:
            return {
                "type": "string",
                "pattern": r.choice(("^[a-c]{1,3}$", "^[0-9]+$", "^x(y|z)?$", "^[A-Z][a-z]{0,2}$")),
            }
        if choice == 9:
            return {"type": "string", "format": r.choice(FORMATS)}
        return {"type": r.choice(("string", "integer", "boolean"))}

    def schema(self, depth: int) -> dict[str, Any]:
        r = self.rng
        if depth <= 0 or r.random() < 0.35:
            return self.leaf()
        choice = r.randrange(8)
        if choice <= 2:
            names = r.sample(NAMES, r.randint(1, 3))
            out: dict[str, Any] = {
                "type": "object",
                "properties": {n: self.schema(depth - 1) for n in names},
                "required": r.sample(names, r.randint(0, len(names))),
            }
            extra = r.randrange(6)
            if extra == 0:
                out["additionalProperties"] = False
            elif extra == 1:
                out["additionalProperties"] = True
            elif extra == 2:
                out["additionalProperties"] = self.leaf()
            elif extra == 3:
                out["patternProperties"] = {"^p[0-9]$": self.leaf()}
            if r.random() < 0.2:
                out["minProperties"] = len(out["required"])
                out["maxProperties"] = len(names)
            return out
        if choice == 3:
            lo = r.randint(0, 2)
            return {"type": "array", "items": self.schema(depth - 1), "minItems": lo, "maxItems": lo + r.randint(0, 2)}
        if choice == 4:
            out = {"type": "array", "prefixItems": [self.schema(depth - 1) for _ in range(r.randint(1, 2))]}
            if r.random() < 0.5:
                out["items"] = r.choice((False, self.leaf()))
                out["maxItems"] = len(out["prefixItems"]) + 1
            return out
        if choice == 5:
            return {
                r.choice(("anyOf", "oneOf")): [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}]
            }
        if choice == 6:
            name = f"d{len(self.defs)}"
            self.defs[name] = {}  # reserve the name: a nested $ref must not reuse it (that makes a loop)
            self.defs[name] = self.schema(depth - 1)
            return {"$ref": f"#/$defs/{name}"}
        return {"allOf": [self.schema(depth - 1)]}


def strict_truth(schema: Any) -> Any:
    """The caller's meaning of ``schema`` under strict mode (see the module docstring)."""
    if isinstance(schema, list):
        return [strict_truth(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs") and isinstance(value, dict):
            out[key] = {k: strict_truth(v) for k, v in value.items()}
        else:
            out[key] = strict_truth(value)
    if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    if "prefixItems" in schema and "items" not in schema:
        out["items"] = False
    return out


def json_schema_case(rng: random.Random) -> tuple[str, pb.Grammar, Callable[[str], str | None], str]:
    gen = _SchemaGen(rng)
    schema = gen.schema(rng.randint(0, 3))
    if gen.defs:
        schema = {**schema, "$defs": gen.defs} if "$ref" not in schema else {"$defs": gen.defs, "allOf": [schema]}
    strict = rng.random() < 0.6
    any_whitespace = rng.random() < 0.2
    separators = rng.choice(SEPARATORS) if rng.random() < 0.4 else None
    grammar = pb.Grammar(json_schema=json.dumps(schema), any_whitespace=any_whitespace)
    grammar.allow_additional_properties = not strict
    if separators is not None:
        grammar.separators.item, grammar.separators.key = separators
    truth = strict_truth(schema) if strict else schema
    check = json_check(truth, any_whitespace, separators or (",", ":"))
    desc = f"json_schema strict={strict} ws={any_whitespace} seps={separators} {json.dumps(schema)}"
    return "json_schema", grammar, check, desc


def any_json_case(rng: random.Random) -> tuple[str, pb.Grammar, Callable[[str], str | None], str]:
    separators = rng.choice(SEPARATORS) if rng.random() < 0.4 else None
    any_whitespace = rng.random() < 0.3
    grammar = pb.Grammar(any_json=pb.AnyJson(), any_whitespace=any_whitespace)
    if separators is not None:
        grammar.separators.item, grammar.separators.key = separators
    check = json_check(True, any_whitespace, separators or (",", ":"))
    return "any_json", grammar, check, f"any_json ws={any_whitespace} seps={separators}"


# ---- regular and recursive grammars --------------------------------------------

_CLASSES = ("a-c", "0-9", "x-z", "a-z0-9", "5-7", "A-C")


def _regular_ast(rng: random.Random, depth: int) -> tuple:
    choice = rng.randrange(5) if depth > 0 else rng.randrange(2)
    if choice == 0:
        return ("lit", "".join(rng.choice("abcxyz0123") for _ in range(rng.randint(1, 3))))
    if choice == 1:
        return ("cls", rng.choice(_CLASSES))
    if choice == 2:
        return ("seq", [_regular_ast(rng, depth - 1) for _ in range(rng.randint(2, 3))])
    if choice == 3:
        return ("alt", [_regular_ast(rng, depth - 1) for _ in range(rng.randint(2, 3))])
    lo = rng.randint(0, 2)
    hi = rng.choice((lo, lo + 1, lo + 3, None))
    return ("rep", _regular_ast(rng, depth - 1), lo, hi)


def _quant(lo: int, hi: int | None) -> tuple[str, str]:
    """(regex/EBNF quantifier, Lark quantifier)."""
    if (lo, hi) == (0, 1):
        return "?", "?"
    if hi is None:
        if lo == 0:
            return "*", "*"
        if lo == 1:
            return "+", "+"
        return f"{{{lo},}}", ""
    return f"{{{lo},{hi}}}", f"~{lo}..{hi}"


def to_regex(node: tuple) -> str:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "cls":
        return f"[{node[1]}]"
    if kind == "seq":
        return "".join(to_regex(n) for n in node[1])
    if kind == "alt":
        return "(" + "|".join(to_regex(n) for n in node[1]) + ")"
    return "(" + to_regex(node[1]) + ")" + _quant(node[2], node[3])[0]


def to_ebnf(node: tuple) -> str:
    kind = node[0]
    if kind == "lit":
        return json.dumps(node[1])
    if kind == "cls":
        return f"[{node[1]}]"
    if kind == "seq":
        return "(" + " ".join(to_ebnf(n) for n in node[1]) + ")"
    if kind == "alt":
        return "(" + " | ".join(to_ebnf(n) for n in node[1]) + ")"
    lo, hi = node[2], node[3]
    inner = "(" + to_ebnf(node[1]) + ")"
    if hi is None and lo > 1:
        return "(" + " ".join([inner] * lo) + " " + inner + "*)"
    return inner + _quant(lo, hi)[0]


def to_lark(node: tuple) -> str:
    kind = node[0]
    if kind == "lit":
        return json.dumps(node[1])
    if kind == "cls":
        return f"/[{node[1]}]/"
    if kind == "seq":
        return "(" + " ".join(to_lark(n) for n in node[1]) + ")"
    if kind == "alt":
        return "(" + " | ".join(to_lark(n) for n in node[1]) + ")"
    lo, hi = node[2], node[3]
    inner = "(" + to_lark(node[1]) + ")"
    if hi is None and lo > 1:
        return "(" + " ".join([inner] * lo) + " " + inner + "*)"
    return inner + _quant(lo, hi)[1]


def regular_case(rng: random.Random) -> tuple[str, pb.Grammar, Callable[[str], str | None], str]:
    ast = _regular_ast(rng, rng.randint(1, 3))
    pattern = to_regex(ast)
    check = regex_check(pattern)
    kind = rng.choice(("regex", "ebnf", "lark"))
    if kind == "regex":
        grammar = pb.Grammar(regex=pattern)
    elif kind == "ebnf":
        grammar = pb.Grammar(ebnf=f"root ::= {to_ebnf(ast)}")
    else:
        grammar = pb.Grammar(lark=f"start: {to_lark(ast)}")
    text = getattr(grammar, kind)
    return kind, grammar, check, f"{kind} {text!r} (checked as regex {pattern!r})"


RECURSIVE = {
    "ebnf": 'root ::= v\nv ::= "[" (v ("," v)*)? "]" | [0-9]',
    "lark": 'start: v\nv: "[" (v ("," v)*)? "]" | /[0-9]/',
}


def recursive_case(rng: random.Random) -> tuple[str, pb.Grammar, Callable[[str], str | None], str]:
    kind = rng.choice(tuple(RECURSIVE))
    grammar = pb.Grammar(ebnf=RECURSIVE[kind]) if kind == "ebnf" else pb.Grammar(lark=RECURSIVE[kind])
    return f"{kind}_recursive", grammar, nested_digits_check, f"{kind} {RECURSIVE[kind]!r}"


# ---- non-ASCII grammars ------------------------------------------------------------
# Multi-byte UTF-8 everywhere a grammar can hold text: Latin-1 ranges (2 bytes), CJK (3),
# emoji (4). Their forced continuations start and end inside characters.

_UNICODE_LITERALS = ("é", "ü", "ß", "日本", "中文", "한국", "😀", "🎉", "Ωμ", "ñ")
_UNICODE_CLASSES = ("à-ÿ", "é-ü", "α-ω", "一-丁", "😀-😂", "a-cé")


def _unicode_ast(rng: random.Random, depth: int) -> tuple:
    choice = rng.randrange(5) if depth > 0 else rng.randrange(2)
    if choice == 0:
        return ("lit", "".join(rng.choice(_UNICODE_LITERALS) for _ in range(rng.randint(1, 2))))
    if choice == 1:
        return ("cls", rng.choice(_UNICODE_CLASSES))
    if choice == 2:
        return ("seq", [_unicode_ast(rng, depth - 1) for _ in range(rng.randint(2, 3))])
    if choice == 3:
        return ("alt", [_unicode_ast(rng, depth - 1) for _ in range(rng.randint(2, 3))])
    lo = rng.randint(0, 2)
    return ("rep", _unicode_ast(rng, depth - 1), lo, rng.choice((lo + 1, lo + 3, None)))


def unicode_regular_case(rng: random.Random) -> tuple[str, pb.Grammar, Callable[[str], str | None], str]:
    ast = _unicode_ast(rng, rng.randint(1, 3))
    pattern = to_regex(ast)
    kind = rng.choice(("regex", "ebnf", "lark"))
    if kind == "regex":
        grammar = pb.Grammar(regex=pattern)
    elif kind == "ebnf":
        grammar = pb.Grammar(ebnf=f"root ::= {to_ebnf(ast)}")
    else:
        grammar = pb.Grammar(lark=f"start: {to_lark(ast)}")
    return f"unicode_{kind}", grammar, regex_check(pattern), f"{kind} {getattr(grammar, kind)!r} (regex {pattern!r})"


def unicode_schema_case(rng: random.Random) -> tuple[str, pb.Grammar, Callable[[str], str | None], str]:
    words = rng.sample(_UNICODE_LITERALS, rng.randint(1, 4))
    pick = rng.randrange(5)
    if pick == 0:
        schema: dict[str, Any] = {"enum": words}
    elif pick == 1:
        schema = {"const": "".join(words)}
    elif pick == 2:
        schema = {"type": "string", "pattern": f"^[{rng.choice(_UNICODE_CLASSES)}]+$"}
    elif pick == 3:
        schema = {"type": "object", "properties": {w: {"type": "integer"} for w in words}, "required": words[:1]}
    else:
        schema = {"type": "array", "items": {"enum": words}, "maxItems": 3}
    separators = rng.choice(SEPARATORS)
    grammar = pb.Grammar(json_schema=json.dumps(schema, ensure_ascii=rng.random() < 0.5))
    grammar.separators.CopyFrom(pb.JsonSeparators(item=separators[0], key=separators[1]))
    check = json_check(strict_truth(schema), False, separators)
    return (
        "unicode_json_schema",
        grammar,
        check,
        f"json_schema {json.dumps(schema, ensure_ascii=False)} seps={separators}",
    )


UNICODE_FAMILIES: tuple[tuple[float, Callable[[random.Random], tuple]], ...] = (
    (0.5, unicode_regular_case),
    (0.5, unicode_schema_case),
)

FAMILIES: tuple[tuple[float, Callable[[random.Random], tuple]], ...] = (
    (0.5, json_schema_case),
    (0.1, any_json_case),
    (0.3, regular_case),
    (0.1, recursive_case),
)


# ---- requests -------------------------------------------------------------------------

# Stop strings a request may carry: JSON punctuation, letters and digits the grammars emit,
# and non-ASCII characters the Unicode families use (a stop inside a character's bytes too).
STOP_STRINGS = ("}", "{", ",", ":", '"', "]", "-", "a", "1", "\n", "é", "ü", "中", "😀", "\\u00e9", "ab")
STOP_FRACTION = 0.3


def random_request(
    rng: random.Random,
    index: int,
    max_k: int,
    max_tokens: int,
    *,
    seeded_only: bool = False,
    families: tuple[tuple[float, Callable[[random.Random], tuple]], ...] = FAMILIES,
) -> Case:
    weights, makers = zip(*families)
    name, grammar, check, desc = rng.choices(makers, weights)[0](rng)
    req = pb.GenerateRequest(request_id=f"lie-{index}", text=rng.choice(PROMPTS))
    req.grammar.CopyFrom(grammar)
    s = req.sampling
    s.temperature = rng.choice(TEMPERATURES)
    top_p, top_k = rng.choice(TOP_PS), rng.choice(TOP_KS)
    if top_p is not None:
        s.top_p = top_p
    if top_k is not None:
        s.top_k = top_k
    if rng.random() < 0.7 or seeded_only:
        s.seed = rng.getrandbits(64)
    s.max_tokens = rng.randint(8, max_tokens)
    if rng.random() < STOP_FRACTION:
        # A stop string may only end an output where the grammar may end: what comes back as
        # STOP is checked like GRAMMAR_COMPLETE.
        s.stop.extend(rng.sample(STOP_STRINGS, rng.randint(1, 3)))
    spec = req.speculation
    mode = rng.randrange(4)
    if mode == 0:
        spec.enabled = False
    else:
        spec.k = rng.randint(0, max_k)
        if spec.k > 0 and mode >= 2:
            spec.proposers.extend(rng.sample(PROPOSERS, rng.randint(1, len(PROPOSERS))))
        if spec.k > 0:
            spec.draft_masking = rng.random() < 0.6
    sampling_desc = (
        f"T={s.temperature} top_p={top_p} top_k={top_k} seed={s.seed if s.HasField('seed') else None} "
        f"max_tokens={s.max_tokens} stop={list(s.stop)!r} spec={str(spec).strip()!r}"
    )
    return Case(name, req, check, f"{desc} | {sampling_desc}")


def generate(
    seed: int, n: int, *, max_k: int, max_tokens: int, seeded_only: bool = False, unicode: bool = False
) -> list[Case]:
    """``n`` cases from ``seed``. ``seeded_only``: every request carries a sampling seed, so
    outputs replay exactly (tests); otherwise 30% are unseeded (the server draws a seed).
    ``unicode``: the non-ASCII families only (UNICODE_FAMILIES)."""
    rng = random.Random(seed)
    families = UNICODE_FAMILIES if unicode else FAMILIES
    return [random_request(rng, i, max_k, max_tokens, seeded_only=seeded_only, families=families) for i in range(n)]
