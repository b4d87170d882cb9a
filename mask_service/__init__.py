"""CPU grammar-mask service: compiled grammars, per-request sessions, batched draft-position bitmasks.

Module map: grammar (GrammarSpec), tokenizer_id (content ids), tokenizers (registry),
backends (engine registry; xgrammar), schema_check (refused JSON-Schema features),
compiler_cache (byte-bounded LRU, off-thread compile), sessions, draft_masks (hot path),
wire (compact row format), convert (spec <-> proto), servicer, server, config, main,
client, router.

What is refused (INVALID_ARGUMENT, never a session that silently allows more):
grammar text the engine rejects (its message is passed through: regex lookaround and
backreferences, EBNF/Lark syntax errors, unsupported JSON types, ...), and JSON-Schema
keywords xgrammar 0.2.8 compiles but does not enforce: not, if/then/else,
uniqueItems: true, dependencies/dependentRequired/dependentSchemas,
contains/minContains/maxContains, multipleOf, unevaluatedProperties/Items,
non-local $ref, $dynamicRef/$recursiveRef, lookaround/backreferences in pattern or
patternProperties, pattern combined with minLength/maxLength. Lark IS supported
(xgrammar Grammar.from_lark). Known gap: xgrammar relaxes a oneOf it cannot prove
disjoint to anyOf (logged by xgrammar), which is not refused.
"""
