"""Loop regions written out for pipelines (`ir/unroll.py`): the same step, layer-stacked
state fed as its rows, and each layer's values kept apart."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from elsewhere import get

from hapsynth.args import state_arity
from hapsynth.ir.signature import input_paths
from hapsynth.ir.trace import Const, evaluate, trace
from hapsynth.ir.unroll import state_inputs, unroll


def _traced(step, args):
    n = len(jax.tree.leaves(args[:state_arity(step, args)]))
    return trace(step, *args), n


def _rows(x, n):
    return [x[i] for i in range(n)] if n else [x]


def _outputs(prog, flat):
    def run(*flat):
        env = evaluate(prog, flat)
        return [o.value if isinstance(o, Const) else env[o] for o in prog.outputs]
    return jax.jit(run)(*flat)


def _readers(prog):
    out: dict = {}
    for e in prog.eqns:
        for x in e.inputs:
            if isinstance(x, int):
                out.setdefault(x, []).append(e)
    return out


@pytest.mark.slow  # compiles the step twice (~11 s); the pipelined scan_gpt runs it too
def test_scan_over_layers_written_out_computes_the_same_step():
    """scan_gpt: every stacked layer parameter and its Adam moments are fed as rows, the
    unrolled program has no loop left and gives the scan's outputs from those rows."""
    step, args = get("scan_gpt")
    prog, n = _traced(step, args)
    u = unroll(prog, n)
    assert not u.loops and prog.loops
    paths = jax.tree_util.tree_flatten_with_path(args[:2])[0]
    layered = [k for k, (p, x) in enumerate(paths) if "layers" in jax.tree_util.keystr(p)]
    assert layered and [k for k, c in enumerate(u.split) if c] == layered
    assert all(u.split[k] == 2 for k in layered)  # tiny: 2 layers
    assert state_inputs(u, n) == len(u.inputs) - (len(prog.inputs) - n)
    assert sum("[row 1]" in p for p in input_paths(u)) == len(layered)

    flat = jax.tree.leaves(args)
    rows = [r for k, x in enumerate(flat) for r in _rows(x, u.split[k] if k < n else 0)]
    want, got = _outputs(prog, flat), _outputs(u, rows)
    it = iter(got)
    n_params = len(jax.tree.leaves(args[0]))
    for k, w in enumerate(want):
        g = jnp.stack([next(it) for _ in range(u.split[k])]) if k < n and u.split[k] else next(it)
        w, g = np.asarray(w), np.asarray(g)
        assert w.shape == g.shape
        # Adam's first step moves a parameter by about lr (1e-2) whatever its gradient:
        # rounding on a near-zero gradient flips it; a misplaced layer is off by ~0.02
        atol = 1e-3 if k < n_params else 1e-5 * max(np.abs(w).max(), 1e-6)
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", ["scan_gpt", "unrolled_gpt"])
def test_a_layer_row_is_read_by_its_layer_only(name):
    """A scan over stacked layers, or a Python loop taking `w[i]` from them: exactly the
    layer-stacked leaves (and their Adam moments) are fed as rows, not the positions
    read as a block (`wpe[:T]`); no row input is stacked again and no gradient is
    padded into a whole stack: the forward, the backward and the optimizer read a
    layer's parameters row by row (a stage stores only its layers)."""
    step, args = get(name)
    prog, n = _traced(step, args)
    u = unroll(prog, n)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    assert {paths[k] for k, c in enumerate(u.split) if c} == {
        p for p in paths[:n] if "['layers']" in p}
    assert not any(e.name == "pad" for e in u.eqns)
    readers = _readers(u)
    rows = [t for t, p in zip(u.inputs, input_paths(u)) if "[row " in p]
    assert rows
    for t in rows:
        near = list(readers.get(t, ()))  # and what reads it through a reshape
        near += [r for e in near if e.name in ("broadcast_in_dim", "reshape", "expand_dims")
                 for r in readers.get(e.outputs[0], ())]
        assert "concatenate" not in {e.name for e in near}, t


def test_only_layer_stacks_are_split_and_global_norms_add_up():
    """A leaf of the loop's length that is not a layer stack (read whole by a matmul)
    stays whole; a global gradient norm sums per-layer sums; the step is unchanged."""
    L, D = 3, 4
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5))

    def loss(params, x):
        def body(h, w):
            return jnp.tanh(h @ w["k"] + w["b"]), None
        h, _ = jax.lax.scan(body, x, params["layers"])
        return jnp.sum((h @ params["mix"].T) ** 2)  # mix: (L, D), not a layer stack

    def step(params, opt, x):
        val, g = jax.value_and_grad(loss)(params, x)
        up, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, up), opt, val

    rng = np.random.default_rng(0)
    params = {"layers": {"k": jnp.asarray(rng.normal(size=(L, D, D)), jnp.float32),
                         "b": jnp.zeros((L, D))},
              "mix": jnp.asarray(rng.normal(size=(L, D)), jnp.float32)}
    args = (params, tx.init(params), jnp.asarray(rng.normal(size=(5, D)), jnp.float32))
    prog, n = _traced(step, args)
    u = unroll(prog, n)
    flat = jax.tree.leaves(args)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    split = {names[k] for k, c in enumerate(u.split) if c}
    assert split == {"[0]['layers']['b']", "[0]['layers']['k']"}
    assert not any("reduce_sum" == e.name and e.in_avals[0].shape[:1] == (L,)
                   and len(e.in_avals[0].shape) == 3 for e in u.eqns)  # norms per layer
    rows = [r for k, x in enumerate(flat) for r in _rows(x, u.split[k] if k < n else 0)]
    got, want = _outputs(u, rows), jax.jit(step)(*args)
    it = iter(got)
    for k, w in enumerate(jax.tree.leaves(want)):
        g = jnp.stack([next(it) for _ in range(u.split[k])]) if k < n and u.split[k] else next(it)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
