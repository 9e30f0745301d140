"""`hapsynth bench pipeline`'s row: programs left untimed print as such, and the speed-ups use
only what was timed."""
import json
import os

import pytest

from hapsynth_bench.pipeline_bench import best_spmd, format_row, timed_programs

ROW = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "pipeline_mlp.json")


def test_a_row_with_every_program_timed_prints_each_speed_up():
    r = json.load(open(ROW))
    text = format_row(r)
    m = r["measured"]
    assert f"{m['SPMD'] / m['free']:9.2f}x" in text
    assert f"{min(m['SPMD'], m['alone']) / m['free']:9.2f}x" in text
    assert "not timed" not in text


def test_programs_left_untimed_print_as_dashes_and_the_better_is_what_was_timed():
    r = json.load(open(ROW))
    for k in ("SPMD", "pipeline"):
        del r["measured"][k]
    r["batch"] = 32
    text = format_row(r)
    assert text.startswith("mlp-paper (batch 32) at 2:1")
    measured = next(line for line in text.splitlines() if line.strip().startswith("measured"))
    assert measured.split()[1:3] == ["-", f"{r['measured']['alone'] * 1e3:.1f}ms"]
    assert best_spmd(r["measured"]) == r["measured"]["alone"]
    ups = [line for line in text.splitlines() if line.strip().startswith("measured")][1]
    assert ups.split()[1:] == ["-", "-", "-", f"{r['measured']['alone'] / r['measured']['free']:.2f}x"]
    assert "SPMD-only across both devices not timed" in text


def test_the_programs_timed_are_named_by_the_environment(monkeypatch):
    monkeypatch.delenv("HAPSYNTH_BENCH_TIMED", raising=False)
    assert timed_programs() == {"SPMD", "alone", "pipeline", "free"}
    monkeypatch.setenv("HAPSYNTH_BENCH_TIMED", "alone, free")
    assert timed_programs() == {"alone", "free"}
    monkeypatch.setenv("HAPSYNTH_BENCH_TIMED", "alone,ticks")
    with pytest.raises(ValueError, match="HAPSYNTH_BENCH_TIMED='alone,ticks'"):
        timed_programs()
