"""Stage 2: the cluster and (to come) the cost model and CP-SAT synthesizer.

catalogue.py (device types) -> cluster.py (classes, hosts, links, TOML, presets).
"""
