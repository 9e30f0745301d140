"""The two ways to lower a loop region whose body needs no collective, timed side by side.

    JAX_NUM_CPU_DEVICES=8 .venv/bin/python benchmarks/loops.py [--reps 15]

- "body" (the default): one `lax.scan`; each iteration runs the body's segments, each a
  `lax.switch` over the groups of devices with equal shard sizes, its S values padded
  back to their stored rows at the end of every iteration;
- "branch": one `lax.switch` whose branches each run the whole scan at their group's
  sizes (carries stay cut to the group's rows; a device picks its branch once).

Both programs come from one plan and run alternately on the 8 simulated CPU devices;
the median step time of each is printed with their ratio, and each checks its losses
against `jax.jit(step)` on one device. Models: a plain-JAX Elman RNN scanned over 128
time steps (tiny body, many iterations) and `tests/elsewhere/scan_gpt` at a small size
(8 layers, width 128: a big body, few iterations). Clusters: two classes 2+6 at 4:1
speeds, four classes 1+1+2+4 at 8:4:2:1 (tests/test_lowering.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
_here = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a script: this folder's modules are the package hapsynth_bench
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.join(os.path.dirname(_here), "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import hapsynth as hs  # noqa: E402


def rnn(batch=256, steps=128, width=128):
    """An Elman RNN over `steps` time steps, squared error on every step's output, SGD."""
    tx = optax.sgd(1e-2)

    def loss_fn(p, xs, ys):
        def cell(h, x):
            h = jnp.tanh(h @ p["w"] + x @ p["u"])
            return h, h
        _, hs_ = jax.lax.scan(cell, jnp.zeros((xs.shape[0], width)), xs.swapaxes(0, 1))
        return ((hs_.swapaxes(0, 1) @ p["o"] - ys) ** 2).mean()

    def step(p, state, xs, ys):
        loss, g = jax.value_and_grad(loss_fn)(p, xs, ys)
        upd, state = tx.update(g, state, p)
        return optax.apply_updates(p, upd), state, loss

    k = jax.random.split(jax.random.key(0), 5)
    p = {"w": jax.random.normal(k[0], (width, width)) / np.sqrt(width),
         "u": jax.random.normal(k[1], (width, width)) / np.sqrt(width),
         "o": jax.random.normal(k[2], (width, 8)) / np.sqrt(width)}
    return step, (p, tx.init(p), jax.random.normal(k[3], (batch, steps, width)),
                  jax.random.normal(k[4], (batch, steps, 8)))


def gpt():
    from elsewhere import scan_gpt

    cfg = scan_gpt.Config(vocab_size=512, d_model=128, n_heads=4, n_layers=8, d_ff=512,
                          max_len=64, batch=64, seq_len=64, lr=1e-3, warmup=1, total_steps=100)
    tx = scan_gpt.make_optimizer(cfg)
    return scan_gpt.make_train_step(scan_gpt.forward, cfg, tx), scan_gpt.example_args(cfg, tx)


MODELS = {"rnn": rnn, "scan_gpt": gpt}


def measure(name: str, cluster_name: str, reps: int) -> dict:
    from test_lowering import CLUSTERS

    from hapsynth.args import signature_of
    from hapsynth.lower.devices import local_devices
    from hapsynth.lower.program import Lowered

    step, args = MODELS[name]()
    par = hs.parallelize(step, cluster=CLUSTERS[cluster_name](), time_limit=2)
    plan = par.plan(*args)
    prog = par._programs[signature_of(args)]
    lows = {f: Lowered(prog, plan, local_devices(par.cluster), loop_form=f)
            for f in ("body", "branch")}
    k = len(args) - (2 if name == "rnn" else 1)  # state leaves lead, the batch follows
    ref = jax.jit(step)(*args)
    state = {}
    for f, low in lows.items():
        out = low(*args)
        np.testing.assert_allclose(float(hs.gather(out)[-1]), float(ref[-1]), rtol=2e-3)
        for _ in range(2):  # warm-up
            out = low(*out[:k], *args[k:])
        state[f] = out
    times = {f: [] for f in lows}
    for _ in range(reps):
        for f, low in lows.items():
            t0 = time.perf_counter()
            state[f] = jax.block_until_ready(low(*state[f][:k], *args[k:]))
            times[f].append(time.perf_counter() - t0)
    med = {f: statistics.median(v) for f, v in times.items()}
    return {"model": name, "cluster": cluster_name, "loops": len(prog.loops),
            "in_branches": len(lows["branch"].branch_loops),
            "body_ms": med["body"] * 1e3, "branch_ms": med["branch"] * 1e3,
            "branch_over_body": med["branch"] / med["body"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--clusters", nargs="*", default=["2+6", "1+1+2+4"])
    a = ap.parse_args(argv)
    print("| model | cluster | loops (in branches) | body ms | branch ms | branch / body |\n"
          "|---|---|---|---|---|---|")
    for name in a.models:
        for c in a.clusters:
            r = measure(name, c, a.reps)
            print(f"| {name} | {c} | {r['loops']} ({r['in_branches']}) | {r['body_ms']:.1f} | {r['branch_ms']:.1f} | "
                  f"{r['branch_over_body']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
