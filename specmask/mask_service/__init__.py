"""CPU grammar-mask service: compiled grammars, per-request sessions, batched draft-position bitmasks.

Module map: grammar (GrammarSpec), tokenizer_id (content ids), tokenizers (registry),
backends (engine registry; xgrammar), schema_check (refused JSON-Schema features),
schema_rewrite + json_regex (rewrites that make the rest enforceable), compiler_cache
(byte-bounded LRU, off-thread compile), sessions, draft_masks (hot path),
wire (compact row format), convert (spec <-> proto), servicer, server, config, main,
client, router.

What is refused (INVALID_ARGUMENT, never a session that silently allows more):
grammar text the engine rejects (its message is passed through: regex lookaround and
backreferences, EBNF/Lark syntax errors, unsupported JSON types, ...), and JSON-Schema
keywords xgrammar 0.2.8 compiles but does not enforce: not, if/then/else,
uniqueItems: true, dependencies/dependentRequired/dependentSchemas,
contains/minContains/maxContains, multipleOf, unevaluatedProperties/Items,
non-local $ref, $dynamicRef/$recursiveRef, lookaround/backreferences in pattern or
patternProperties, pattern combined with minLength/maxLength, allOf with more than
one subschema (xgrammar compiles it to "any JSON value") or next to other validation
keywords (xgrammar drops them), $ref/const/enum/anyOf/oneOf next to other validation
keywords (xgrammar keeps only the first of $ref > const > enum > anyOf/oneOf; a
redundant or movable `type` excepted), a type no enum/const value or anyOf/oneOf
branch can have (unsatisfiable), a `type` next to $ref whose target may have another
type, required names missing from properties next to patternProperties/propertyNames
or with additionalProperties: false, a format xgrammar enforces (email, date, date-time,
time, duration, ipv4, ipv6, hostname, uuid, uri, uri-reference, uri-template,
json-pointer, relative-json-pointer) combined with pattern/minLength/maxLength
(xgrammar drops those), and a pattern/patternProperties key that needs a '"', a
backslash or a control character (xgrammar would emit it raw), inline flags or \b.

What is rewritten instead (schema_rewrite; always equal or stricter than the
schema): every pattern is re-emitted with its character classes limited to
characters a JSON string may hold raw; format email / json-pointer /
relative-json-pointer become JSON-safe patterns (xgrammar's admit invalid escapes
or raw control characters); a schema without a type whose string, number,
object (required, min/maxProperties, propertyNames, patternProperties) or array
(minItems, maxItems, additionalItems) keywords xgrammar would ignore gets that type;
required names missing from properties are added with the additionalProperties
schema; a type next to anyOf/oneOf is moved into every branch (intersected with the
branch's type, filtering its enum/const, dropping branches that cannot match) and a
type next to enum filters its values; and the character class of
minLength/maxLength strings is narrowed in xgrammar's grammar to exclude
U+0000-U+001F (xgrammar admits them raw; escapes stay unavailable there).
Lark IS supported (xgrammar Grammar.from_lark). Known gaps, not refused: xgrammar
relaxes a oneOf it cannot prove disjoint to anyOf (logged by xgrammar).

Never-lie checks on every grammar, whichever engine compiles it
(grammar_checks, code_points, ebnf_classes): a JSON Schema must be valid against its
draft's metaschema and hold no lone surrogate, non-finite number (1e400) or nesting
beyond schema_check.MAX_SCHEMA_DEPTH; regex/EBNF/Lark text may not name a surrogate
or a code point above U+10FFFF; a compiled grammar whose first mask allows no token
(empty language) or only stop tokens (only "") is refused. Object keys: see
schema_check (patternProperties/propertyNames combinations xgrammar does not
enforce are refused; non-strict mode adds additionalProperties: false where
patternProperties govern the extra keys). JSON-schema grammars have every character
class narrowed to exclude the surrogate block (xgrammar admitted ED A0..BF bytes).
"""

import specmask.proto  # noqa: F401  (before any gRPC use: turns gRPC fork support off; see specmask/proto/__init__.py)
