"""The system text that asks a model for a JSON document of a schema (opt-in on the API side).

Shared by the orchestrator, which adds it to a chat on request, and the draft distiller, which
renders its training prompts the same way.
"""

from __future__ import annotations

import json

# The text a JSON Schema chat gets when it asks for the instruction; "{schema}" becomes the schema
# as compact JSON. Follows JSONSchemaBench's prompt (Geng et al. 2025, arXiv 2501.10868): the
# schema in a system message.
DEFAULT_SCHEMA_INSTRUCTION = (
    "You need to generate a JSON object that matches the schema below. Reply with the JSON object only.\n"
    "Schema:\n{schema}"
)
SCHEMA_PLACEHOLDER = "{schema}"


def schema_instruction(schema_json: str, template: str | None = None) -> str:
    """The system text for a JSON Schema request; ``template`` None = the default."""
    try:
        compact = json.dumps(json.loads(schema_json), separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        compact = schema_json
    return (DEFAULT_SCHEMA_INSTRUCTION if template is None else template).replace(SCHEMA_PLACEHOLDER, compact)
