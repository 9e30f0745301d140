"""`ir/cse.py`: a step's own recomputation (`jax.checkpoint`) undone, values unchanged."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hapsynth.ir.cse import merge_recomputed
from hapsynth.ir.trace import evaluate, trace


def _step(remat: bool, prevent_cse: bool = True):
    def layer(x, w):
        return jnp.tanh(x @ w)

    block = jax.checkpoint(layer, prevent_cse=prevent_cse) if remat else layer

    def loss(ws, x):
        for w in ws:
            x = block(x, w)
        return jnp.sum(x ** 2)

    def step(ws, x):
        g = jax.grad(loss)(ws, x)
        return [w - 0.1 * d for w, d in zip(ws, g)]
    k = jax.random.split(jax.random.key(0), 4)
    ws = [jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(3)]
    return step, (ws, jax.random.normal(k[3], (8, 16)))

def _dots(prog) -> int:
    return sum(e.name == "dot_general" for e in prog.eqns)

@pytest.mark.parametrize("prevent_cse", [True, False])
def test_recomputed_blocks_merge_into_the_forward(prevent_cse):
    """Each checkpointed block's forward, recomputed in the backward (behind an
    `optimization_barrier` with `prevent_cse`), merges into the forward's own: as many
    matmuls as the step written without `jax.checkpoint`, and the same results."""
    step, args = _step(True, prevent_cse)
    prog = trace(step, *args)
    merged = merge_recomputed(prog)
    other, same = _step(False)
    plain = trace(other, *same)
    assert merged is not None and _dots(prog) > _dots(merged) == _dots(plain)
    flat = jax.tree.leaves(args)
    a, b = evaluate(prog, flat), evaluate(merged, flat)
    for x, y in zip(prog.outputs, merged.outputs):
        np.testing.assert_array_equal(np.asarray(a[x]), np.asarray(b[y]))
    np.testing.assert_allclose(np.asarray(b[merged.outputs[0]]),
                               np.asarray(jax.jit(step)(*args)[0]), rtol=1e-5, atol=1e-6)

def test_a_step_recomputing_nothing_is_left_alone():
    step, args = _step(False)
    assert merge_recomputed(trace(step, *args)) is None

def test_a_program_with_loop_regions_is_left_alone():
    def step(ws, x):
        body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
        return jax.grad(lambda ws: jnp.sum(jax.lax.scan(body, x, ws)[0]))(ws)
    prog = trace(step, jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
    assert prog.loops and merge_recomputed(prog) is None


@pytest.mark.parametrize("name", [pytest.param("unrolled_gpt", marks=pytest.mark.slow), "scan_gpt"])
def test_spmd_runs_a_checkpointed_step_without_its_recomputation(name):
    """A step whose blocks are under `jax.checkpoint` (a Python loop over the layers, or
    a scan, written out for this with no leaf fed as rows), on devices
    with memory to spare: the plan runs it with the recomputation undone (fewer FLOPs,
    `plan.remat` says so), and 3 steps equal one-device `jit`, from the plan and from its
    JSON (which rebuilds the same program)."""
    import hapsynth as hs
    from test_elsewhere import get as elsewhere
    from test_freerun import _equals_jit

    step, args = elsewhere(name)
    cluster = hs.Cluster.simulated([("A100", 4), ("V100", 4)])
    par = hs.parallelize(step, cluster=cluster, time_limit=1)
    plan = par.plan(*args)
    assert plan.remat and plan.remat["undone"] and plan.remat["merged"] > 0
    assert ("unrolled" in plan.remat) == (name == "scan_gpt")
    assert "recomputation undone" in plan.summary()
    as_written = hs.parallelize(step, cluster=cluster, time_limit=1, remat=False).plan(*args)
    assert as_written.remat is None
    assert plan.baselines["ideal"] < as_written.baselines["ideal"]  # less work
    _equals_jit(par, step, args)
    again = hs.parallelize(step, cluster=cluster, plan=hs.Plan.from_json(plan.to_json()))
    _equals_jit(again, step, args)


@pytest.mark.slow  # (~15 s; the checkpointed scan_gpt run stays)
def test_auto_reports_the_spmd_time_whichever_program_it_keeps():
    """`pipeline="auto"` on islands, the step as written against it with its
    recomputation undone: whichever plan is kept, `baselines["SPMD"]` is the better
    SPMD-only time of the two, and a kept SPMD plan says why no pipeline."""
    import hapsynth as hs
    from test_elsewhere import get as elsewhere
    from test_pipeline import two_islands

    step, args = elsewhere("unrolled_gpt")
    plan = hs.parallelize(step, cluster=two_islands(), time_limit=1).plan(*args)
    written = hs.parallelize(step, cluster=two_islands(), time_limit=1,
                             remat=False).plan(*args)
    assert plan.baselines["SPMD"] <= written.baselines["SPMD"]
    if not plan.stages:
        assert plan.baselines["SPMD"] == plan.predicted_step_time
        assert plan.solver["pipeline"]
