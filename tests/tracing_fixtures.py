"""The ``spans`` fixture: tracing on for one test, its finished spans kept in memory.

Registered for every test directory by the root conftest (``pytest_plugins``), so each tracing
test uses the same set-up and tear-down. OpenTelemetry is imported only when a test asks for
the fixture: loading this plugin imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from specmask.common import tracing

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing installed with an in-memory exporter (spans exported as each ends, no batching),
    shut down after the test, so none of its spans or its provider reaches another test."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.install(exporter, "test", batch=False)
    try:
        yield exporter
    finally:
        tracing.shutdown()
