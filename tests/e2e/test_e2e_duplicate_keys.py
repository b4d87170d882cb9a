"""Open maps never end in a repeated key: the mask service refuses them while decoding.

The tiny random-init pair writes short keys over a two-letter alphabet, so without
the refusal (grammar/json_keys.py) it repeats keys within a few entries and the
end check fails those requests as grammar violations. With it, every request
completes with distinct keys, sampled and greedy, with and without draft masking.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import PROMPT, ThreadStack

pytestmark = pytest.mark.slow

# Keys from a two-letter alphabet, at most 8 long: the random model repeats one soon
# (greedy, it writes "bbbbbbbb" again and again). Values are one digit.
OPEN_MAP = {
    "type": "object",
    "patternProperties": {"^[ab]{1,8}$": {"type": "integer", "minimum": 0, "maximum": 9}},
    "additionalProperties": False,
}
# A flat object of such keys and digits: every key, also in an output cut by length.
KEY = re.compile(r'[{,]"([ab]+)":')


@pytest.fixture()
def client(stack: ThreadStack) -> Iterator[OrchestratorClient]:
    with OrchestratorClient(stack.address) as c:
        yield c


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.0, speculation=True, k=4),
        dict(temperature=1.0, speculation=True, k=4),
        dict(temperature=1.0, speculation=True, k=4, draft_masking=False),
        dict(temperature=1.0, speculation=False),
    ],
    ids=["greedy", "sampled", "sampled-unmasked-drafts", "sampled-plain"],
)
def test_open_map_outputs_never_repeat_a_key(client: OrchestratorClient, options: dict[str, object]) -> None:
    seeds = range(1) if options["temperature"] == 0.0 else range(8)
    keys_seen = 0
    for seed in seeds:
        req = build_request(PROMPT, schema=OPEN_MAP, max_tokens=200, seed=seed, **options)  # type: ignore[arg-type]
        res = client.generate(req, timeout_s=300)
        assert res.finish_reason in (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_LENGTH), (
            seed,
            res.finish_reason,
            res.error,
            res.text,
        )
        keys = KEY.findall(res.text)
        assert len(keys) == len(set(keys)), (seed, res.text)
        if res.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
            assert sorted(json.loads(res.text)) == sorted(keys)
        keys_seen += len(keys)
    assert keys_seen >= len(seeds)  # the model wrote keys, so repeats were possible
