"""instructor against the HTTP API, in the modes people use: ``Mode.JSON`` (JSON mode plus
instructor's own schema prompt), ``Mode.JSON_SCHEMA`` (``response_format`` json_schema) and
``Mode.TOOLS`` (a forced function call).

instructor runs in a virtual environment of its own (tests/fixtures/instructor_env.py: its
releases cannot share the suite's pinned ``openai``). The environment is built from the package
index (instructor with the ``openai`` it resolves); without an index the test is skipped, with
the reason.

A grammar-enforced mode must hand back a valid object on the first try (instructor's own
retries are off). JSON mode is only "some JSON object" to the server; the script checks that
instructor parses it into a model that accepts any object, and that what came back is an
object, so a non-JSON answer or a refused request fails it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.stack import ThreadStack
from tests.fixtures import instructor_env

pytestmark = pytest.mark.slow

_SCRIPT = r"""
import json, sys
from typing import Any, Literal

import instructor
import openai
from pydantic import BaseModel, ConfigDict, Field

base_url, model = sys.argv[1], sys.argv[2]


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    celsius: int = Field(ge=-90, le=60)  # bounded: a tiny random model may not stop digits


class Anything(BaseModel):
    model_config = ConfigDict(extra="allow")


raw = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
out = {"openai": openai.__version__, "instructor": instructor.__version__}
for mode in ("JSON_SCHEMA", "TOOLS"):
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    try:
        w = client.chat.completions.create(
            model=model, response_model=Weather, max_retries=0, max_tokens=150, temperature=0,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
        )
    except Exception as exc:  # the completion instructor refused, for the test's message
        sys.exit(f"{mode}: {exc!r}: {getattr(exc, 'last_completion', None)!r}"[:4000])
    out[mode] = w.model_dump()
# JSON mode is "any object" to the server: a tiny random model may wander inside a string
# until max_tokens, so a few seeds are tried. An answer cut at max_tokens is the model's;
# anything else instructor raises (an error status, a complete answer it cannot parse) fails.
client = instructor.from_openai(raw, mode=instructor.Mode.JSON)
out["JSON"] = {"cut": 0}
for seed in range(8):
    try:
        obj, completion = client.chat.completions.create_with_completion(
            model=model, response_model=Anything, max_retries=0, max_tokens=120, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Describe Paris as a JSON object."}],
        )
    except Exception as exc:
        if type(exc).__name__ == "IncompleteOutputException":  # v1 and v2 clients raise their own class
            out["JSON"]["cut"] += 1
            continue
        sys.exit(f"JSON: {exc!r}: {getattr(exc, 'last_completion', None)!r}"[:4000])
    out["JSON"].update(parsed=obj.model_dump(), text=completion.choices[0].message.content)
    break
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def instructor_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python, why = instructor_env.build(tmp_path_factory.mktemp("instructor-venv"))
    if python is None:
        pytest.skip(why)
    return python


def test_instructor_modes(stack: ThreadStack, model: str, instructor_python: Path) -> None:
    base_url = stack.http_url + "/v1"
    proc = instructor_env.run(instructor_python, _SCRIPT, base_url, model)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("JSON_SCHEMA", "TOOLS"):
        assert out[mode]["city"] in ("Paris", "Oslo") and isinstance(out[mode]["celsius"], int), out
    assert "text" in out["JSON"], f"no JSON-mode answer completed in 8 seeds: {out}"
    assert isinstance(json.loads(out["JSON"]["text"]), dict), out
