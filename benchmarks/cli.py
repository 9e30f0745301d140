"""`hapsynth bench overhead|hetero|pipeline|overlap`: `hapsynth.cli` parses the command and calls `bench`."""
from __future__ import annotations

import json


def bench(kind: str, model: str | None = None, config: str | None = None,
          reps: int | None = None, ratios=(2.0, 3.0), as_json: bool = False,
          link: str | None = "100mbit", batch: int | None = None) -> int:
    """Run one benchmark and print its result; the exit status."""
    if kind == "overhead":
        from hapsynth_bench import overhead

        return overhead.main(model or "gpt", config or "tiny", reps or 20)
    if kind == "pipeline":
        from hapsynth_bench import pipeline_bench

        row = pipeline_bench.run(model or "gpt", config or "small", ratio=ratios[0],
                                 reps=reps or 8, link=None if link in (None, "none") else link,
                                 batch=batch)
        print(json.dumps(row, indent=1) if as_json else pipeline_bench.format_row(row))
        return 0
    if kind == "overlap":
        from hapsynth_bench import overlap

        row = overlap.run(None if link in (None, "none") else link, reps=reps or 7)
        print(json.dumps(row, indent=1) if as_json else overlap.format_row(row))
        return 0
    if kind != "hetero":
        raise ValueError(f"no benchmark {kind!r} (overhead, hetero, pipeline, overlap)")
    from hapsynth_bench import hetero

    models = [model + "-" + (config or "tiny")] if model else list(hetero.MODELS)
    rows = hetero.run(models, ratios=ratios, reps=reps or 8)
    print(json.dumps(rows, indent=1) if as_json else hetero.format_rows(rows))
    return 0
