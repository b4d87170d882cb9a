"""Fuzz both services with malformed, oversized and contradictory requests (deterministic seeds).

Every request must come back with a typed status (never UNKNOWN, never a
crash), invalid ones with INVALID_ARGUMENT before any GPU work, and both
servers must still report SERVING afterwards.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.message import DecodeError

from specmask.mask_service.client.mask_client import RECONNECT_OPTIONS
from specmask.orchestrator.dev.local_stack import health_status
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as mpb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as mpb_grpc
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

N_STRUCTURED = 1200
N_RAW = 300
N_MASK = 1200
THREADS = 8
OVERLOAD_RETRIES = 8
SERVING = 1
MAX_MODEL_LEN = 512  # the tiny pair's context
VOCAB = 300  # the tiny pair's vocabulary


def _base(rng: random.Random) -> pb.GenerateRequest:
    """A valid request; mutations below make it invalid."""
    req = pb.GenerateRequest(request_id=f"fuzz-{rng.randrange(10**9)}")
    if rng.random() < 0.5:
        req.text = rng.choice(["hello", "Generate JSON:\n", "x" * rng.randint(1, 50)])
    else:
        req.token_ids.ids.extend(rng.randrange(VOCAB) for _ in range(rng.randint(1, 20)))
    if rng.random() < 0.5:
        req.grammar.json_schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}})
    if rng.random() < 0.5:
        req.sampling.temperature = rng.uniform(0, 2)
    if rng.random() < 0.3:
        req.sampling.top_p = rng.uniform(0.05, 1)
    req.sampling.max_tokens = rng.randint(1, 8)
    return req


def _mutations() -> list[Callable[[pb.GenerateRequest, random.Random], None]]:
    def prompt_empty(r, rng):
        r.text = ""

    def prompt_unset(r, rng):
        r.ClearField("text")
        r.ClearField("token_ids")

    def ids_empty(r, rng):
        r.token_ids.SetInParent()
        del r.token_ids.ids[:]

    def ids_out_of_vocab(r, rng):
        r.token_ids.ids.extend([rng.choice([VOCAB, VOCAB + 1, 2**31, 2**32 - 1])])

    def prompt_too_long(r, rng):
        r.token_ids.ids.extend([1] * (MAX_MODEL_LEN + rng.randint(0, 100)))

    def text_oversized(r, rng):
        r.text = "a" * (64 * MAX_MODEL_LEN + 1 + rng.randint(0, 10_000))

    def temperature(r, rng):
        r.sampling.temperature = rng.choice([-1e-3, -5.0, math.nan, math.inf, -math.inf, 1e6])

    def top_p(r, rng):
        r.sampling.top_p = rng.choice([0.0, -0.5, 1.0001, 7.0, math.nan])

    def top_k(r, rng):
        r.sampling.top_k = rng.choice([-1, -(2**31)])

    def max_tokens(r, rng):
        r.sampling.max_tokens = rng.choice([0, -1, -(2**31), MAX_MODEL_LEN, 2**31 - 1])

    def stop_bad(r, rng):
        choice = rng.randrange(3)
        if choice == 0:
            r.sampling.stop.append("")
        elif choice == 1:
            r.sampling.stop.extend(str(i) for i in range(17))
        else:
            r.sampling.stop.append("s" * 257)

    def k_bad(r, rng):
        r.speculation.k = rng.choice([-1, 9, 100, 2**31 - 1, -(2**31)])

    def contradictory_spec(r, rng):
        r.speculation.enabled = False
        if rng.random() < 0.5:
            r.speculation.k = rng.randint(1, 8)
        else:
            r.speculation.proposers.append(pb.PROPOSER_NGRAM)

    def proposer_bad(r, rng):
        r.speculation.proposers.append(rng.choice([0, 4, 99, -3]))

    def grammar_no_kind(r, rng):
        r.grammar.Clear()
        r.grammar.any_whitespace = True

    def schema_not_json(r, rng):
        r.grammar.json_schema = rng.choice(["{", "nope", "[1,2", '{"type": }', "\x00\x01"])

    def schema_unsupported(r, rng):
        r.grammar.checked = False  # exact or refused: the server's default would relax the first four
        r.grammar.json_schema = json.dumps(
            rng.choice(
                [
                    {"type": "object", "not": {"type": "string"}},
                    {"if": {"type": "string"}, "then": {"minLength": 2}},
                    {"type": "array", "uniqueItems": True},
                    # (multipleOf and dependentRequired are no longer here: llguidance enforces the
                    # first, the exact rewrites expand the second into object shapes; both are served.)
                    {"$ref": "http://example.com/remote.json"},
                ]
            )
        )

    def schema_contradictory(r, rng):
        r.grammar.json_schema = json.dumps(
            rng.choice(
                [
                    {"type": "integer", "minimum": 10, "maximum": 1},
                    {"type": "string", "minLength": 5, "maxLength": 2},
                    {"type": "array", "minItems": 4, "maxItems": 1},
                    {"enum": []},
                ]
            )
        )

    def regex_bad(r, rng):
        r.grammar.regex = rng.choice(["(", "[a-", "a{2,1}", "(?<=a)b", "\\"])

    def ebnf_bad(r, rng):
        r.grammar.ebnf = rng.choice(["root ::= missing", "root ::= (", "nothing here", "root ::= [z-a]"])

    def lark_bad(r, rng):
        r.grammar.lark = rng.choice(["start: missing_rule", "start: (", "%import nowhere.x"])

    def json_opts_on_regex(r, rng):
        r.grammar.regex = "[a-z]+"
        r.grammar.any_whitespace = True

    def separators_bad(r, rng):
        r.grammar.any_json.SetInParent()
        r.grammar.separators.item = rng.choice(["", ";", ",,", " x ", "," + " " * 20])
        r.grammar.separators.key = ":"

    def grammar_oversized(r, rng):
        r.grammar.regex = "a" * ((1 << 20) + 1)

    def grammar_empty(r, rng):
        r.grammar.json_schema = ""

    def request_id_bad(r, rng):
        r.request_id = rng.choice(["has space", "x" * 129, "tab\tid", "ünïcode", "new\nline"])

    return [
        prompt_empty,
        prompt_unset,
        ids_empty,
        ids_out_of_vocab,
        prompt_too_long,
        text_oversized,
        temperature,
        top_p,
        top_k,
        max_tokens,
        stop_bad,
        k_bad,
        contradictory_spec,
        proposer_bad,
        grammar_no_kind,
        schema_not_json,
        schema_unsupported,
        schema_contradictory,
        regex_bad,
        ebnf_bad,
        lark_bad,
        json_opts_on_regex,
        separators_bad,
        grammar_oversized,
        grammar_empty,
        request_id_bad,
    ]


def _structured_cases(n: int, seed: int = 0) -> list[tuple[str, pb.GenerateRequest]]:
    rng = random.Random(seed)
    mutations = _mutations()
    cases = []
    for i in range(n):
        req = _base(rng)
        # Every mutation in turn (then at random), plus 0-2 more on top.
        chosen = [mutations[i % len(mutations)]] + rng.sample(mutations, rng.randint(0, 2))
        for m in chosen:
            m(req, rng)
        cases.append(("+".join(m.__name__ for m in chosen), req))
    return cases


def _call(fn: Callable[[], object]) -> grpc.StatusCode:
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_orchestrator_structured_fuzz(stack: ThreadStack) -> None:
    cases = _structured_cases(N_STRUCTURED)
    with grpc.insecure_channel(stack.address) as channel:
        stub = pb_grpc.OrchestratorServiceStub(channel)

        def one(case: tuple[str, pb.GenerateRequest]) -> tuple[str, grpc.StatusCode]:
            name, req = case
            for attempt in range(OVERLOAD_RETRIES + 1):
                if len(name) % 2:  # both RPCs, deterministically
                    code = _call(lambda: stub.Generate(req, timeout=60))
                else:
                    code = _call(lambda: list(stub.GenerateStream(req, timeout=60)))
                # Eight threads of distinct bad grammars from one client can outrun its share of
                # a replica's compile queue (4 waiting): that answer is overload, not the verdict;
                # back off and ask again, as a client should.
                if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    break
                time.sleep(0.5 * (attempt + 1))
            return name, code

        with ThreadPoolExecutor(THREADS) as pool:
            results = list(pool.map(one, cases))
    wrong = Counter(f"{name}: {code.name}" for name, code in results if code is not grpc.StatusCode.INVALID_ARGUMENT)
    assert not wrong, f"expected INVALID_ARGUMENT for all: {wrong.most_common(10)}"
    assert health_status(stack.address) == SERVING
    # The router hides a replica that dies (it fails over), so look at each one.
    stack.assert_replicas_serving()
    assert stack.wait_idle() == ([0, 0], 0)


def test_orchestrator_raw_bytes_fuzz(stack: ThreadStack) -> None:
    """Arbitrary bytes as the request message: undecodable ones and invalid ones get INVALID_ARGUMENT."""
    rng = random.Random(1)
    valid_bytes = [pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()]
    payloads = []
    for i in range(N_RAW):
        if i % 3 == 0:  # flip bytes in a valid message: mostly decodable, semantically odd
            b = bytearray(rng.choice(valid_bytes))
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            payloads.append(bytes(b))
        else:
            payloads.append(bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))))
    method = "/specmask.orchestrator.v1.OrchestratorService/Generate"
    with grpc.insecure_channel(stack.address) as channel:
        call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)

        def one(payload: bytes) -> tuple[bool, grpc.StatusCode]:
            try:
                pb.GenerateRequest.FromString(payload)
                decodable = True
            except DecodeError:
                decodable = False
            return decodable, _call(lambda: call(payload, timeout=60))

        with ThreadPoolExecutor(THREADS) as pool:
            results = list(pool.map(one, payloads))
    for decodable, code in results:
        if decodable:
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK), code
        else:
            assert code is grpc.StatusCode.INVALID_ARGUMENT, code
    assert health_status(stack.address) == SERVING
    stack.assert_replicas_serving()
    assert stack.wait_idle() == ([0, 0], 0)


def _mask_cases(n: int, tokenizer_id: str, seed: int = 2) -> list[tuple[str, object]]:
    rng = random.Random(seed)
    kinds = [0, 1, 2, 3, 4, 5, 6, 99]
    texts = [
        "",
        "{",
        '{"type":"integer"}',
        "[a-z]+",
        "(",
        'root ::= "a"',
        "start: x",
        "\x00" * 3,
        "a" * 5000,
        json.dumps({"not": {}}),
        json.dumps({"type": "string", "pattern": "(?=a)"}),
    ]
    tok_ids = [tokenizer_id, "", "tok-unknown", "x" * 300, "tok-" + "0" * 32]
    cases: list[tuple[str, object]] = []
    for i in range(n):
        which = i % 7
        grammar = mpb.Grammar(
            kind=rng.choice(kinds),
            text=rng.choice(texts),
            any_whitespace=rng.random() < 0.3,
            has_separators=rng.random() < 0.2,
            item_separator=rng.choice(["", ",", ";;"]),
            key_separator=rng.choice(["", ":", "=>"]),
            strict=rng.random() < 0.5,
        )
        if which == 0:
            target = mpb.GrammarTarget(
                tokenizer_id=rng.choice(tok_ids),
                grammar=grammar,
                vocab_size=rng.choice([0, 1, 31, VOCAB - 1, VOCAB, 2**20, 2**32 - 1]),
            )
            cases.append(("ValidateGrammar", mpb.ValidateGrammarRequest(target=target)))
        elif which == 1:
            # Never a valid tokenizer: an accepted open would leak a session.
            target = mpb.GrammarTarget(tokenizer_id=rng.choice(tok_ids[1:]), grammar=grammar)
            owner = rng.choice(["", "fuzz-owner", "o" * 300])
            cases.append(("OpenSession", mpb.OpenSessionRequest(target=target, owner=owner)))
        elif which == 2:
            tokens = [rng.randint(-(2**31), 2**31 - 1) for _ in range(rng.randint(0, 20))]
            cases.append(
                (
                    "Commit",
                    mpb.CommitRequest(
                        session_id=rng.choice(["", "nope", "x" * 1000]),
                        seq=rng.choice([0, 1, 2**64 - 1]),
                        tokens=tokens,
                    ),
                )
            )
        elif which == 3:
            items = [
                mpb.DraftMaskItem(
                    session_id=rng.choice(["", "missing", "y" * 500]),
                    draft_tokens=[rng.randint(-5, 10**6) for _ in range(rng.randint(0, 40))],
                    commit_tokens=[rng.randint(-5, 10**6) for _ in range(rng.randint(0, 5))],
                    commit_seq=rng.choice([0, 1, 7]),
                    last_row_only=rng.random() < 0.5,
                )
                for _ in range(rng.randint(0, 6))
            ]
            cases.append(
                (
                    "DraftMasks",
                    mpb.DraftMasksRequest(
                        items=items,
                        client_id=rng.choice(["", "c", "z" * 300]),
                        dict_generation=rng.choice([0, 1, 2**64 - 1]),
                    ),
                )
            )
        elif which == 4:
            cases.append(("CloseSession", mpb.CloseSessionRequest(session_id=rng.choice(["", "gone", "q" * 999]))))
        elif which == 5:
            # Never a live worker's owner ("gpu-worker-<actor id>"): nothing real is released.
            owner = rng.choice(["", "fuzz-owner", "gpu-worker-", "o" * 300, "\x00"])
            cases.append(("ReleaseOwner", mpb.ReleaseOwnerRequest(owner=owner)))
        else:
            cases.append(("SessionCount", mpb.SessionCountRequest()))
    return cases


def test_mask_service_fuzz(stack: ThreadStack) -> None:
    assert stack.running is not None
    stack.assert_replicas_serving()
    tokenizer_id = stack.running.server.info.tokenizer_id
    cases = _mask_cases(N_MASK, tokenizer_id)
    allowed = {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
    # Its own connection (not one in another channel's reconnect backoff), and
    # connected before the burst: this test is about answers, not reconnects.
    options = [("grpc.use_local_subchannel_pool", 1), *RECONNECT_OPTIONS]
    for replica in stack.running.mask_services:
        with grpc.insecure_channel(replica.address, options=options) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = mpb_grpc.MaskServiceStub(channel)

            def one(case: tuple[str, object]) -> tuple[str, grpc.StatusCode]:
                method, req = case
                return method, _call(lambda: getattr(stub, method)(req, timeout=60))

            with ThreadPoolExecutor(THREADS) as pool:
                results = list(
                    pool.map(one, cases[: N_MASK // 2] if replica is not stack.running.mask_services[0] else cases)
                )
        wrong = Counter(f"{m}:{c.name}" for m, c in results if c not in allowed)
        assert not wrong, (wrong, replica.returncode, replica.log_tail())
        assert health_status(replica.address) == SERVING
    assert stack.mask_session_count() == 0
