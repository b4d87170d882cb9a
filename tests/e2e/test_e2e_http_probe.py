"""A hostile user's probe of the HTTP API, concurrent with well-formed constrained requests.

One wave: odd Unicode in stop strings, choices, schemas, regexes and grammars (astral,
combining, right-to-left, NUL, lone surrogates escaped in the JSON text), extreme parameters,
stop strings inside a schema's JSON strings, ``structured_outputs`` with every combination of
its constraint fields, bad JSON bodies, wrong types, a body past the size limit, ``n > 1``,
streams with ``stream_options`` and clients that leave mid-stream, all at once, beside
well-formed grammar requests. Asserted:

* no 5xx, and no stream that ends in an error event;
* every 200 obeys every constraint it was sent (jsonschema, regex fullmatch, choice
  membership, the grammar's finite language), and a finish by ``stop`` under stop strings
  holds none of them;
* a request that can only be refused is refused (4xx), never answered;
* every well-formed request succeeds, whatever fails beside it;
* afterwards no worker holds a sequence and no mask replica a session.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
import jsonschema
import pytest

from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
IN_FLIGHT = 12  # below the stack's batch + queue: overload is not what this probes
_TIMEOUT = httpx.Timeout(300.0)

Check = Callable[[str], None]  # raises AssertionError when the text breaks the constraint


@dataclass(frozen=True)
class Probe:
    name: str
    path: str
    body: dict[str, Any] | bytes
    # A 200 with finish "stop" must pass every check; an empty tuple = nothing to check.
    checks: tuple[Check, ...] = ()
    good: bool = False  # well-formed: must be a 200 that finishes by "stop" and passes
    refused: bool = False  # can only be refused: must be a 4xx
    stream: bool = False
    leave_after_first_chunk: bool = False


def schema_check(schema: dict[str, Any]) -> Check:
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema)

    return check


def regex_check(pattern: str) -> Check:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not fullmatch {pattern!r}"

    return check


def one_of(options: list[str]) -> Check:
    def check(text: str) -> None:
        assert text in options, f"{text!r} is not one of {options!r}"

    return check


def json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def no_stop_string(stops: list[str]) -> Check:
    def check(text: str) -> None:
        assert not any(s in text for s in stops), f"{text!r} holds a stop string of {stops!r}"

    return check


# ---- the constraints the probes use -------------------------------------------------------

BOUNDED = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}
UNICODE_SCHEMA = {
    "type": "object",
    "properties": {
        "\u05e9\u05dd": {"enum": ["\U0001f600", "e\u0301", "\u202eabc", "a\u0000b", "\U00010348"]},
        "n": {"type": "integer", "minimum": -3, "maximum": 3},
    },
    "required": ["\u05e9\u05dd", "n"],
    "additionalProperties": False,
}
# A stop string that the schema's strings hold: it may end the output only where the JSON is complete.
IN_STRING_SCHEMA = {
    "type": "object",
    "properties": {"s": {"enum": ['a}b"c', "x,y:z"]}},
    "required": ["s"],
    "additionalProperties": False,
}
UNICODE_CHOICES = ["\U0001f600", "e\u0301", "\u05e9\u05dc\u05d5\u05dd", "\u202eabc", "a\u0000b", "\U0001f1fa\U0001f1f8"]
UNICODE_REGEX = "(\U0001f600|e\u0301|[\u05d0-\u05ea]|\U00010348){1,4}"
ASCII_REGEX = r"(yes|no)-[0-9]{2}"
EBNF = 'root ::= "sky " colour\ncolour ::= "\U0001f535" | "gr\u00e9y" | "e\u0301"'
EBNF_LANGUAGE = ["sky \U0001f535", "sky gr\u00e9y", "sky e\u0301"]
LARK = 'start: "sky " colour\ncolour: "blue" | "grey"'
LARK_LANGUAGE = ["sky blue", "sky grey"]

# structured_outputs' constraint fields, each with a value and the check of its language.
SO_FIELDS: dict[str, tuple[Any, Check]] = {
    "json": (BOUNDED, schema_check(BOUNDED)),
    "regex": (ASCII_REGEX, regex_check(ASCII_REGEX)),
    "choice": (["red", "green"], one_of(["red", "green"])),
    "grammar": (LARK, one_of(LARK_LANGUAGE)),
    "json_object": (True, json_object),
}


def _chat(model: str, content: str = "Say something.", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 48, **extra}


def _completion(model: str, prompt: str = "Answer:", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 48, **extra}


def _good(model: str) -> list[Probe]:
    """Well-formed constrained requests: each must succeed beside the hostile ones."""
    probes = [
        Probe(
            "good-so-" + name,
            CHAT,
            _chat(model, structured_outputs={name: value}, temperature=1.0, seed=i),
            (check,),
            good=True,
        )
        for i, (name, (value, check)) in enumerate(SO_FIELDS.items())
        if name != "json_object"  # any JSON object need not end within a small budget
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOUNDED}}
    probes += [
        Probe("good-response-format", CHAT, _chat(model, response_format=fmt), (schema_check(BOUNDED),), good=True),
        Probe(
            "good-guided-regex-completion",
            COMPLETIONS,
            _completion(model, guided_regex=ASCII_REGEX, temperature=0.7, seed=3),
            (regex_check(ASCII_REGEX),),
            good=True,
        ),
        Probe(
            "good-stream-usage",
            CHAT,
            _chat(
                model,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                structured_outputs={"json": BOUNDED},
            ),
            (schema_check(BOUNDED),),
            good=True,
            stream=True,
        ),
        Probe(
            "good-stop-in-schema-strings",
            CHAT,
            _chat(model, structured_outputs={"json": IN_STRING_SCHEMA}, stop=["}", '"', ",", ":"], seed=5),
            (schema_check(IN_STRING_SCHEMA),),
            good=True,
        ),
    ]
    return probes


def _unicode(model: str) -> list[Probe]:
    stops = ["\U0001f600", "e\u0301", "\u202e", "\u0000", "\U0001f1fa\U0001f1f8", "\u05e9"]
    return [
        Probe(
            "unicode-stop-strings",
            COMPLETIONS,
            _completion(model, stop=stops, temperature=1.5, seed=2),
            (no_stop_string(stops),),
        ),
        Probe(
            "unicode-stop-strings-stream",
            COMPLETIONS,
            _completion(model, stop=stops, temperature=1.5, seed=3, stream=True),
            (no_stop_string(stops),),
            stream=True,
        ),
        Probe(
            "unicode-choice",
            CHAT,
            _chat(model, structured_outputs={"choice": UNICODE_CHOICES}, temperature=1.0, seed=1),
            (one_of(UNICODE_CHOICES),),
        ),
        Probe(
            "unicode-guided-choice-stream",
            COMPLETIONS,
            _completion(model, guided_choice=UNICODE_CHOICES, stream=True, temperature=1.0, seed=4),
            (one_of(UNICODE_CHOICES),),
            stream=True,
        ),
        Probe(
            "unicode-schema",
            CHAT,
            _chat(model, structured_outputs={"json": UNICODE_SCHEMA}, temperature=1.0, seed=6),
            (schema_check(UNICODE_SCHEMA),),
        ),
        Probe(
            "unicode-regex",
            COMPLETIONS,
            _completion(model, structured_outputs={"regex": UNICODE_REGEX}, temperature=1.0, seed=7),
            (regex_check(UNICODE_REGEX),),
        ),
        Probe(
            "unicode-ebnf",
            CHAT,
            _chat(model, structured_outputs={"grammar": EBNF}, temperature=1.0, seed=8),
            (one_of(EBNF_LANGUAGE),),
        ),
        Probe(
            "unicode-choice-with-stops",
            CHAT,
            _chat(
                model,
                structured_outputs={"choice": UNICODE_CHOICES},
                stop=["\u0301", "\U0001f1f8", "b"],
                temperature=1.0,
                seed=9,
            ),
            (one_of(UNICODE_CHOICES),),
        ),
        Probe(
            "unicode-include-stop",
            CHAT,
            _chat(
                model,
                structured_outputs={"choice": UNICODE_CHOICES},
                stop=["\u0301", "\u05dd"],
                include_stop_str_in_output=True,
                temperature=1.0,
                seed=10,
            ),
            (one_of(UNICODE_CHOICES),),
        ),
    ]


def _lone_surrogates(model: str) -> list[Probe]:
    """Escaped lone surrogates: valid JSON text, but no Unicode string: refused wherever they are."""
    cases = {
        "stop": '"stop": ["\\ud800"]',
        "choice": '"structured_outputs": {"choice": ["a", "\\udfff"]}',
        "regex": '"structured_outputs": {"regex": "a\\ud800"}',
        "schema": '"structured_outputs": {"json": {"enum": ["\\ud83d"]}}',
        "grammar": '"structured_outputs": {"grammar": "root ::= \\"\\udc00\\""}',
        "content": '"stop": "x", "seed": 1',
    }
    probes = []
    for name, field in cases.items():
        content = "\\ud800 hi" if name == "content" else "hi"
        message = f'{{"role": "user", "content": "{content}"}}'
        raw = f'{{"model": "{model}", "max_tokens": 4, "messages": [{message}], {field}}}'
        probes.append(Probe(f"surrogate-{name}", CHAT, raw.encode(), refused=True))
    return probes


def _extreme(model: str) -> list[Probe]:
    choice = ["red", "green"]
    check = (one_of(choice),)
    so = {"choice": choice}

    def p(name: str, refused: bool = False, **extra: Any) -> Probe:
        return Probe(f"extreme-{name}", CHAT, _chat(model, structured_outputs=so, **extra), check, refused=refused)

    return [
        p("max-tokens-0", refused=True, max_tokens=0),
        p("max-tokens-1", max_tokens=1),
        p("max-tokens-huge", refused=True, max_tokens=10**12),
        p("max-tokens-2-70", refused=True, max_tokens=2**70),
        p("max-completion-tokens-negative", refused=True, max_completion_tokens=-5),
        p("temperature-huge", refused=True, temperature=1e300),
        p("temperature-max", temperature=100.0, seed=1),
        p("temperature-negative", refused=True, temperature=-1.0),
        p("top-p-tiny", top_p=1e-300, temperature=1.0, seed=2),
        p("top-p-zero", refused=True, top_p=0.0),
        p("min-p-1", min_p=1.0, temperature=1.0, seed=3),
        p("min-p-over", refused=True, min_p=1.0000001),
        p("min-tokens-equals-max", min_tokens=8, max_tokens=8),
        p("min-tokens-over-max", refused=True, min_tokens=9, max_tokens=8),
        p("min-tokens-negative", refused=True, min_tokens=-1),
        p("seed-negative", seed=-1, temperature=1.0),
        p("seed-2-64", seed=2**64, temperature=1.0),
        p("seed-2-63-minus-1", seed=2**63 - 1, temperature=1.0),
        p("top-k-huge", top_k=2**64, temperature=1.0, seed=4),
        p("top-k-negative", refused=True, top_k=-2),
        p("stop-token-ids-huge", stop_token_ids=[2**40, 2**63], temperature=1.0, seed=5),
        p("stop-token-ids-negative", refused=True, stop_token_ids=[-1]),
        p("stop-token-ids-many", refused=True, stop_token_ids=list(range(1000))),
        p("min-tokens-with-stop-ids", min_tokens=1, stop_token_ids=[0, 1, 2, 299, 300, 10**9], temperature=1.0),
        p("logprobs-top-20", logprobs=True, top_logprobs=20),
        p("logprobs-top-21", refused=True, logprobs=True, top_logprobs=21),
        p("speculation-k-huge", refused=True, speculation={"k": 10**9}),
        p("speculation-off", speculation={"enabled": False}, temperature=1.0, seed=6),
        p("stop-many", refused=True, stop=[f"s{i}" for i in range(1000)]),
        p("stop-long", refused=True, stop=["x" * 100_000]),
        p("stop-empty", refused=True, stop=[""]),
        p("n-2", refused=True, n=2),
        p("n-huge", refused=True, n=10**30),
        p("n-zero", refused=True, n=0),
        p("best-of", refused=True, best_of=3),
    ]


def _structured_output_combinations(model: str) -> list[Probe]:
    """Every combination of structured_outputs' constraint fields, alone and together; a 200 must
    obey every constraint it was given (one dropped silently would be a lie)."""
    probes = []
    names = sorted(SO_FIELDS)
    for r in range(1, len(names) + 1):
        for combo in itertools.combinations(names, r):
            so = {name: SO_FIELDS[name][0] for name in combo}
            checks = tuple(SO_FIELDS[name][1] for name in combo)
            probes.append(
                Probe(
                    f"so-{'+'.join(combo)}",
                    CHAT,
                    _chat(model, structured_outputs=so, temperature=1.0, seed=r),
                    checks,
                    refused=r > 1,
                )
            )
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOUNDED}}
    probes += [
        Probe("so-empty", CHAT, _chat(model, structured_outputs={}, max_tokens=4)),
        Probe(
            "so-and-response-format",
            CHAT,
            _chat(model, structured_outputs={"regex": ASCII_REGEX}, response_format=fmt),
            (regex_check(ASCII_REGEX), schema_check(BOUNDED)),
            refused=True,
        ),
        Probe(
            "so-and-guided",
            CHAT,
            _chat(model, structured_outputs={"choice": ["red"]}, guided_regex="blue"),
            (one_of(["red"]), regex_check("blue")),
            refused=True,
        ),
        Probe("so-false-json-object", CHAT, _chat(model, structured_outputs={"json_object": False}, max_tokens=4)),
        Probe(
            "so-json-text",
            CHAT,
            _chat(model, structured_outputs={"json": json.dumps(BOUNDED)}),
            (schema_check(BOUNDED),),
        ),
        Probe("so-json-not-json", CHAT, _chat(model, structured_outputs={"json": "{not json"}), refused=True),
        Probe("so-json-bad-schema", CHAT, _chat(model, structured_outputs={"json": {"type": 5}}), refused=True),
        Probe("so-regex-bad", CHAT, _chat(model, structured_outputs={"regex": "(unclosed"}), refused=True),
        Probe("so-grammar-bad", CHAT, _chat(model, structured_outputs={"grammar": "root ::= "}), refused=True),
        Probe("so-choice-empty", CHAT, _chat(model, structured_outputs={"choice": []}), refused=True),
        Probe("so-choice-string", CHAT, _chat(model, structured_outputs={"choice": "red"}), refused=True),
        Probe("so-choice-ints", CHAT, _chat(model, structured_outputs={"choice": [1, 2]}), refused=True),
        Probe("so-unknown-key", CHAT, _chat(model, structured_outputs={"regex": "a", "x": 1}), refused=True),
        Probe("so-structural-tag", CHAT, _chat(model, structured_outputs={"structural_tag": "{}"}), refused=True),
        Probe("so-not-object", CHAT, _chat(model, structured_outputs="json"), refused=True),
        Probe(
            "so-whitespace-pattern",
            CHAT,
            _chat(model, structured_outputs={"json": BOUNDED, "whitespace_pattern": "[ ]*"}),
            (schema_check(BOUNDED),),
        ),
        Probe(
            "so-disable-any-whitespace",
            CHAT,
            _chat(model, structured_outputs={"json": BOUNDED, "disable_any_whitespace": True}),
            (schema_check(BOUNDED),),
        ),
    ]
    return probes


def _bad_bodies(model: str) -> list[Probe]:
    raw = [
        b"",
        b"{",
        b"[]",
        b"null",
        b'"text"',
        b"\xff\xfe{}",
        b'{"model": }',
        b"[" * 200_000 + b"]" * 200_000,
        b'{"model": "' + model.encode() + b'", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"model": "' + model.encode() + b'", "prompt": "x", "temperature": NaN}',
        b'{"model": "' + model.encode() + b'", "prompt": "x", "top_p": Infinity}',
        b'{"model": "' + model.encode() + b'", "prompt": "x", "max_tokens": 1e400}',
        b'{"model": "' + model.encode() + b'", "prompt": "x", "max_tokens": 4, "max_tokens": -4}',
    ]
    probes = [Probe(f"bad-json-{i}", COMPLETIONS, body, refused=True) for i, body in enumerate(raw)]
    wrong_types: list[dict[str, Any]] = [
        {"messages": "hi"},
        {"messages": [{"role": 1, "content": "x"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": []},
        {"max_tokens": "10"},
        {"max_tokens": 10.5},
        {"temperature": "hot"},
        {"stop": 5},
        {"stop": [1, 2]},
        {"stop_token_ids": ["a"]},
        {"stop_token_ids": 3},
        {"include_stop_str_in_output": "yes"},
        {"min_tokens": "1"},
        {"seed": 1.5},
        {"chat_template_kwargs": "x"},
        {"stream": "true"},
        {"stream_options": {"include_usage": True}},  # without stream
        {"model": 5},
        {"response_format": {"type": "xml"}},
        {"guided_decoding_backend": "outlines", "guided_regex": "a"},
    ]
    for i, fields in enumerate(wrong_types):
        probes.append(Probe(f"wrong-type-{i}", CHAT, {**_chat(model), **fields}, refused=True))
    probes.append(Probe("model-unknown", CHAT, _chat("no-such-model"), refused=True))
    probes.append(Probe("body-too-large", COMPLETIONS, _completion(model, prompt="a" * (17 * 1024**2)), refused=True))
    probes.append(Probe("prompt-past-context", COMPLETIONS, _completion(model, prompt="ab " * 300_000), refused=True))
    probes.append(
        Probe("prompt-ids-outside-vocab", COMPLETIONS, _completion(model, prompt=[1, 2, 10**12]), refused=True)
    )
    return probes


def _streams(model: str) -> list[Probe]:
    leave = [
        Probe(
            f"leave-mid-stream-{i}",
            CHAT,
            _chat(
                model,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=200,
                structured_outputs={"json": BOUNDED} if i % 2 else None,
                temperature=1.0,
                seed=i,
            ),
            leave_after_first_chunk=True,
            stream=True,
        )
        for i in range(4)
    ]
    return [
        *leave,
        Probe(
            "stream-include-usage-regex",
            COMPLETIONS,
            _completion(
                model, stream=True, stream_options={"include_usage": True}, structured_outputs={"regex": ASCII_REGEX}
            ),
            (regex_check(ASCII_REGEX),),
            stream=True,
        ),
        Probe(
            "stream-so-stop-ids",
            CHAT,
            _chat(
                model,
                stream=True,
                structured_outputs={"choice": ["red", "green"]},
                stop_token_ids=[0, 5, 6],
                include_stop_str_in_output=True,
                temperature=1.0,
                seed=11,
            ),
            (one_of(["red", "green"]),),
            stream=True,
        ),
    ]


@dataclass
class Outcome:
    status: int
    text: str | None = None
    finish: str | None = None
    error: Any = None


async def _send(client: httpx.AsyncClient, probe: Probe) -> Outcome:
    content = probe.body if isinstance(probe.body, bytes) else json.dumps(probe.body).encode()
    headers = {"Content-Type": "application/json"}
    if not probe.stream:
        try:
            resp = await client.post(probe.path, content=content, headers=headers)
        except httpx.TransportError as exc:
            # A server may answer a body past its limit and close before reading the rest.
            return Outcome(413 if probe.name == "body-too-large" else 0, error=repr(exc))
        if resp.status_code != 200:
            return Outcome(resp.status_code, error=resp.text[:300])
        choice = resp.json()["choices"][0]
        text = choice["message"]["content"] if probe.path == CHAT else choice["text"]
        return Outcome(200, text, choice["finish_reason"])
    async with client.stream("POST", probe.path, content=content, headers=headers) as resp:
        if resp.status_code != 200:
            return Outcome(resp.status_code, error=(await resp.aread())[:300])
        parts, finish, usage, done = [], None, None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return Outcome(500, error=event["error"])  # an error event: a failure like a 5xx
            if probe.leave_after_first_chunk:
                return Outcome(200)  # leaving: the context manager closes the connection
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
        if not done or finish is None:
            return Outcome(0, error=f"stream ended without a finish and [DONE] (finish {finish}, done {done})")
        include_usage = isinstance(probe.body, dict) and (probe.body.get("stream_options") or {}).get("include_usage")
        if include_usage and not (usage and usage["completion_tokens"] >= 0):
            return Outcome(0, error=f"stream_options.include_usage sent no usage: {usage}")
        return Outcome(200, "".join(parts), finish)


def _judge(probe: Probe, out: Outcome) -> str | None:
    """What is wrong with ``out`` (None: nothing)."""
    if out.status >= 500 or out.status == 0:
        return f"{probe.name}: {out.status} {out.error}"
    if probe.good and (out.status != 200 or out.finish != "stop"):
        return f"{probe.name}: well-formed but {out.status} {out.finish} {out.error}"
    if probe.refused and out.status == 200:
        return f"{probe.name}: answered ({out.finish}: {out.text!r}) where only a refusal is right"
    if out.status == 200 and out.finish == "stop" and out.text is not None:
        for check in probe.checks:
            try:
                check(out.text)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                return f"{probe.name}: a lie: {out.text!r}: {str(exc)[:200]}"
    if out.status == 200 and out.finish not in ("stop", "length", None):
        return f"{probe.name}: finish {out.finish!r}"
    return None


async def _wave(base_url: str, probes: list[Probe]) -> list[Outcome]:
    gate = asyncio.Semaphore(IN_FLIGHT)
    async with httpx.AsyncClient(base_url=base_url, timeout=_TIMEOUT) as client:

        async def one(probe: Probe) -> Outcome:
            async with gate:
                return await _send(client, probe)

        return await asyncio.gather(*(one(p) for p in probes))


def test_hostile_requests_beside_well_formed_ones(stack: ThreadStack) -> None:
    base_url = stack.http_url
    model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    hostile = [
        *_unicode(model),
        *_lone_surrogates(model),
        *_extreme(model),
        *_structured_output_combinations(model),
        *_bad_bodies(model),
        *_streams(model),
    ]
    good = _good(model)
    # Interleaved: every well-formed request has failing neighbours in flight.
    step = max(1, len(hostile) // len(good))
    probes = list(hostile)
    for i, probe in enumerate(good):
        probes.insert(i * (step + 1), probe)
    outcomes = asyncio.run(_wave(base_url, probes))
    problems = [p for p in (_judge(probe, out) for probe, out in zip(probes, outcomes, strict=True)) if p]
    statuses = sorted({(probe.name, out.status, out.finish) for probe, out in zip(probes, outcomes, strict=True)})
    print("\n".join(map(str, statuses)))  # the wave's answers, shown with pytest -rP
    assert not problems, "\n".join(problems) + "\n\n" + "\n".join(map(str, statuses))
    answered = sum(out.status == 200 for out in outcomes)
    assert answered >= len(good), statuses
    active, sessions = stack.wait_idle(timeout_s=60)
    assert not any(active) and sessions == 0, (active, sessions)
