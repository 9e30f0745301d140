"""Built-in cluster presets: TOML package data, installed as `hapsynth.cluster.presets`."""
