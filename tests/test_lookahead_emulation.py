"""bench/lookahead_emulation.py: the one-chunk lookahead form of the scan's chain gives the fp64 recurrence's
outputs as closely as today's form does (CPU only)."""
import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parent.parent / "bench" / "lookahead_emulation.py"
_spec = importlib.util.spec_from_file_location("lookahead_emulation", _path)
emulation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emulation)


@pytest.mark.parametrize("g_scale", [0.1, 0.001])
def test_lookahead_matches_todays_accuracy(g_scale):
    errs, diff = emulation.errors(tokens=640, g_scale=g_scale, value_heads=2, key_heads=1)
    (today_o, today_h), (ahead_o, ahead_h) = errs["today"], errs["lookahead"]
    assert 0 < diff < 1e-2  # different roundings, the same values
    assert today_o < 1e-2 and today_h < 1e-2
    assert ahead_o < 1.25 * today_o and ahead_h < 1.25 * today_h
