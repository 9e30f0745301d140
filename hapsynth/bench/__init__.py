"""Benchmarks measured side by side in one run: `hapsynth bench overhead|hetero`."""
