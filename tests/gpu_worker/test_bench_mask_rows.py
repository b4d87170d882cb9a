"""bench.mask_rows runs, checks both paths name the same rows, and reports a RESULT line."""

from __future__ import annotations

import json

import pytest

from bench import mask_rows


@pytest.mark.parametrize("upload", [False, True])
def test_bench_mask_rows_reports_both_paths(capsys, upload):
    argv = ["--batches", "2", "--vocabs", "smollm2", "--steps", "2"] + (["--upload"] if upload else [])
    assert mask_rows.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("RESULT ")
    cell = json.loads(line[len("RESULT ") :])["cells"]["smollm2"]["2"]
    assert cell["dense_ms"] > 0 and cell["ids_ms"] > 0
