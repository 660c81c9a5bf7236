"""benchmarks.lib.util: what every benchmark's files are made of."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.lib.util import write_outputs


def test_results_are_strict_json_a_nan_or_inf_is_null(tmp_path: Path) -> None:
    data = {"rows": [{"p95": math.nan, "ratio": math.inf, "ok": 1.5}], "pair": (2.0, -math.inf)}
    json_path, md_path = write_outputs(tmp_path, "x", data, "| a |\n")
    got = json.loads(
        json_path.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))
    )
    assert got == {"rows": [{"p95": None, "ratio": None, "ok": 1.5}], "pair": [2.0, None]}
    assert md_path.read_text() == "| a |\n"
