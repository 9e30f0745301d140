"""The lowered program equals `jax.jit(train_step)` on one device, step after step."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hapsynth as hs
from hapsynth.lower.devices import local_devices
from hapsynth.ir.layout import Layout
from hapsynth.lower.values import Sharded, shard_array
from hapsynth.models import get


def _cluster(text: str) -> hs.Cluster:
    return hs.Cluster.from_toml(text)


def _cls(name, count, speed):
    return (f'[[class]]\ntype = "CPU"\nname = "{name}"\ncount = {count}\nhost = 0\n'
            f'flops = "{90 * speed}GFLOP/s"\nmem_bandwidth = "{10 * speed}GB/s"\n')


CLUSTERS = {
    "even": lambda: hs.Cluster.load("cpu8-even"),
    "2+6": lambda: _cluster(_cls("fast", 2, 4) + _cls("slow", 6, 1)),
    "1+1+2+4": lambda: _cluster(_cls("a", 1, 8) + _cls("b", 1, 4) + _cls("c", 2, 2) + _cls("d", 4, 1)),
}


def compare(got, want, rtol=2e-3, atol=1e-5):
    """Leafwise comparison; a mismatch names the leaf and by how much."""
    gl, tree = jax.tree.flatten(got)
    wl = jax.tree.leaves(want)
    assert len(gl) == len(wl)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    for path, g, w in zip(paths, gl, wl):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{path}: shape {g.shape} vs {w.shape}"
        err = np.max(np.abs(g - w)) if g.size else 0.0
        scale = max(np.max(np.abs(w)) if w.size else 0.0, 1.0)
        assert err <= atol + rtol * scale, f"{path}: max abs error {err:.3g} (scale {scale:.3g})"


def run_three_steps(model, cluster):
    step, (params, opt, batch) = get(model, "tiny")
    par = hs.parallelize(step, cluster=cluster, time_limit=1, devices="all")
    ref = jax.jit(step)
    want = (params, opt)
    got = (params, opt)
    for _ in range(3):
        want = ref(*want[:2], batch)
        got = par(*got[:2], batch)   # outputs flow back in as Sharded values
        compare(hs.gather(got), want)
    return par.plan(params, opt, batch)


@pytest.mark.parametrize("model", ["mlp", "vgg", *(pytest.param(m, marks=pytest.mark.slow)
                                                  for m in ("vit", "bert", "gpt", "moe"))])
def test_zoo_on_two_classes(model):
    run_three_steps(model, CLUSTERS["2+6"]())


@pytest.mark.parametrize("model,cluster", [
    ("mlp", "even"), ("mlp", "1+1+2+4"),
    *(pytest.param(m, c, marks=pytest.mark.slow)  # gpt and vgg on 2+6 run by default
      for m, c in (("gpt", "even"), ("vgg", "even"), ("gpt", "1+1+2+4"), ("vgg", "1+1+2+4")))])
def test_more_clusters(model, cluster):
    plan = run_three_steps(model, CLUSTERS[cluster]())
    if cluster == "1+1+2+4" and model == "vgg":
        # uneven shards, including devices that hold nothing of some dim
        assert any(len(set(u)) > 1 for u in plan.shard_units.values())
        assert any(0 in u for u in plan.shard_units.values())


@pytest.mark.parametrize("gspmd", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_even_plan_lowers_to_jit_with_named_shardings(gspmd):
    """Even shards everywhere: plain jit + NamedSharding (no branches); the shard_map
    lowering of the same plan gives the same results."""
    from hapsynth.lower.program import Lowered

    step, args = get("gpt", "tiny")
    par = hs.parallelize(step, cluster="cpu8-even", strategy="data-parallel")
    plan = par.plan(*args)
    assert len(set(plan.shard_units[16])) == 1  # the batch, split 2 rows per device
    assert par.lowered(*args).mode == "gspmd"
    low = Lowered(par._programs[next(iter(par._programs))], plan, local_devices(par.cluster),
                  gspmd=gspmd)
    assert low.mode == ("gspmd" if gspmd else "shard_map")
    want, got = args[:2], args[:2]
    for _ in range(3):
        want = jax.jit(step)(*want[:2], args[2])
        got = low(*got[:2], args[2])
        compare(hs.gather(got), want)


@pytest.mark.parametrize("model", [pytest.param("gpt", marks=pytest.mark.slow), "vgg"])
def test_shard_map_program_keeps_fast_kernels(model):
    """Uneven data parallelism (branches): the step's forward and backward stay in one
    segment (the loss's all-reduce does not split them, so activations need not leave a
    branch padded; only an embedding's gradient, summed into a partial sum, waits), and every convolution reaches XLA in the layout of its library
    kernels (backward passes emit others, which XLA CPU otherwise runs in a naive loop)."""
    import re

    step, args = get(model, "tiny")
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), strategy="data-parallel")
    low = par.lowered(*args)
    assert low.mode == "shard_map" and len(low.group_rep) >= 2
    sharded = [sum(low.plan.op_factors[o] >= 0 for o in seg) for seg in low.segments]
    assert len(sharded) <= 3 and sum(sharded[1:]) <= 0.01 * sum(sharded), sharded
    hlo = low._fn.lower(*low._stored(jax.tree.leaves(args))).compile().as_text()
    labels = re.findall(r"convolution\(.*?dim_labels=([^,\s]+)", hlo)
    assert (len(labels) > 0) == (model == "vgg")
    assert set(labels) <= {"b01f_01io->b01f"}, set(labels)
    compare(hs.gather(low(*args)), jax.jit(step)(*args))


def test_ops_reading_only_earlier_values_run_beside_their_readers():
    """Uneven data parallelism (branches): an op whose operands all come from before its
    segment (Adam's `b1 * m`, a weight's transpose for the backward) runs in the segment
    of its first reader, not the earliest segment it could: a value leaving a branch is
    a pass of its own, kept alive until read, where beside its reader XLA fuses it.
    The program still equals one device."""
    step, args = get("mlp", "tiny")
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), strategy="data-parallel")
    low = par.lowered(*args)
    assert low.mode == "shard_map" and len(low.segments) >= 2
    eqns, needs, lays = low.prog.eqns, low.plan.op_inputs, low.plan.tensor_layouts
    seg_of = {o: k for k, seg in enumerate(low.segments) for o in seg}
    made = {t: seg_of[o] for o in seg_of for t in eqns[o].outputs}
    moved = 0
    for o, k in seg_of.items():
        if any(made.get(x, -1) == k for x in eqns[o].inputs if isinstance(x, int)):
            continue  # reads a value of its own segment
        readers = [(seg_of[r], need) for r in seg_of for x, need in zip(
            eqns[r].inputs, needs[r]) if x in eqns[o].outputs]
        if not readers:
            continue
        latest = min(kr - (need is not None and lays[x] != need)
                     for x in eqns[o].outputs for kr, need in readers)
        assert k == latest, (eqns[o].primitive, k, latest)
        moved += k > 0
    assert moved > 0  # the optimizer's state-only ops left the first segment
    compare(hs.gather(low(*args)), jax.jit(step)(*args))


def test_weight_gradients_leave_branches_in_row_order():
    """Uneven data parallelism: a weight gradient's dot, transposed by the backward
    (`cpu.keep_dot`), is made with its operands swapped, so no branch returns a matrix
    in a transposed layout to be copied back in row order outside (XLA CPU ran the
    copies at a fraction of memory speed: 414 ms against 62 ms, three 4096x4096)."""
    import re

    step, args = get("mlp", "tiny")
    low = hs.parallelize(step, cluster=CLUSTERS["2+6"](), strategy="data-parallel").lowered(*args)
    assert low.mode == "shard_map"
    hlo = low._fn.lower(*low._stored(jax.tree.leaves(args))).compile().as_text()
    results = [ln.split("conditional(")[0] for ln in hlo.splitlines() if " conditional(" in ln]
    assert results
    transposed = [m for r in results for m in re.findall(r"f32\[\d+,\d+\]\{0,1\}", r)]
    assert not transposed, transposed
    compare(hs.gather(low(*args)), jax.jit(step)(*args))


layouts = st.sampled_from(["R", "P", "S0", "S1"])


@settings(max_examples=25, deadline=None)
@given(layout=layouts, rows=st.integers(1, 13), cols=st.integers(1, 5),
       weights=st.lists(st.integers(0, 5), min_size=8, max_size=8).filter(lambda w: sum(w) > 0))
def test_gather_of_shard_is_identity(layout, rows, cols, weights):
    from hapsynth.synth.pricing import shard_units  # noqa: F401  (sizes come from a plan normally)

    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) - 7.5
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("d",))
    if layout.startswith("S"):
        dim = int(layout[1])
        n = x.shape[dim]
        w = np.asarray(weights, float)
        units = np.floor(n * w / w.sum()).astype(int)
        units[np.argmax(w)] += n - units.sum()
        lay, table = Layout("S", dim, n), {n: tuple(int(u) for u in units)}
    else:
        lay, table = Layout(layout), {}
    data = shard_array(x, lay, table, mesh)
    value = Sharded(data, lay, x.shape, table.get(lay.units))
    np.testing.assert_array_equal(np.asarray(hs.gather({"a": [value]})["a"][0]), x)


def test_changed_argument_shape_replans_or_names_the_leaf():
    step, (params, opt, batch) = get("mlp", "tiny")
    par = hs.parallelize(step, cluster="cpu8-even", time_limit=1)
    par(params, opt, batch)
    smaller = jax.tree.map(lambda x: x[:16], batch)  # a new signature: planned anew
    out = par(params, opt, smaller)
    compare(hs.gather(out), jax.jit(step)(params, opt, smaller))
    assert len(par._plans) == 2


UNITS = {12: (5, 3, 1, 0, 1, 1, 1, 0), 10: (0, 2, 2, 1, 1, 1, 1, 2)}
CONVERSIONS = [("S0/12", "R", "padded"), ("S0/12", "R", "grouped"), ("P", "R", None),
               ("P", "S1/10", "padded"), ("P", "S1/10", "grouped"), ("S0/12", "S1/10", "padded"),
               ("R", "S1/10", None), ("R", "P", None), ("S1/10", "P", None), ("S1/10", "S0/12", None)]


@pytest.mark.parametrize("src,dst,form", CONVERSIONS)
def test_each_collective_form_on_uneven_shards(src, dst, form):
    """Every conversion the lowering emits, on shards [5,3,1,0,...] / [0,2,2,1,...]."""
    from hapsynth.lower.collectives import convert
    from hapsynth.lower.values import spec, unshard

    x = np.arange(120, dtype=np.float32).reshape(12, 10) / 7 - 3
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("d",))
    s, d = Layout.parse(src), Layout.parse(dst)
    stored = shard_array(x, s, UNITS, mesh)

    def body(v):
        v = v[0] if s.kind == "P" else v
        out = convert(v, s, d, x.shape, UNITS, form)
        return out[None] if d.kind == "P" else out

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec(s, 2), out_specs=spec(d, 2),
                              check_vma=False))
    got = unshard(Sharded(f(stored), d, x.shape, UNITS.get(d.units)))
    np.testing.assert_allclose(np.asarray(got), x, rtol=1e-6, atol=1e-6)


def test_shard_feeds_each_device_its_rows_and_changes_nothing():
    step, (params, opt, batch) = get("gpt", "tiny")
    par = hs.parallelize(step, cluster=CLUSTERS["2+6"](), time_limit=1, devices="all")
    fed = par.shard(params, opt, batch)
    stored = jax.tree.leaves(fed[2], is_leaf=lambda v: isinstance(v, Sharded))
    assert all(isinstance(v, Sharded) for v in stored)
    assert any(v.layout.sharded for v in stored)  # the batch arrives split
    compare(hs.gather(par(*fed)), jax.jit(step)(params, opt, batch))


def test_data_parallel_strategy_is_the_dp_cp_baseline():
    step, args = get("mlp", "tiny")
    plan = hs.parallelize(step, cluster=CLUSTERS["2+6"](), strategy="data-parallel").plan(*args)
    assert plan.chosen == "DP-CP"
    assert plan.predicted_step_time == pytest.approx(plan.baselines["DP-CP"])


def test_more_devices_than_jax_sees_is_a_clear_error():
    step, args = get("mlp", "tiny")
    big = hs.Cluster.load("a100x8-v100x8-100g")  # 16 devices; the tests have 8
    with pytest.raises(hs.ClusterError, match=r"16 devices.*only 8"):
        hs.parallelize(step, cluster=big, time_limit=1)(*args)


@pytest.mark.parametrize("form", [pytest.param("body", marks=pytest.mark.slow), "branch"])
def test_both_loop_forms_equal_one_device(form):  # "body", the default, runs everywhere else
    """A scan over time lowered either way (benchmarks/loops.py times them) gives the
    single-device step's results; the branch form is taken by both scans (forward and
    backward), whose bodies need no collective."""
    from hapsynth.args import signature_of
    from hapsynth.lower.program import Lowered
    from hapsynth_bench.loops import rnn

    step, args = rnn(batch=64, steps=6, width=32)
    par = hs.parallelize(step, cluster=CLUSTERS["1+1+2+4"](), time_limit=1, devices="all")
    plan = par.plan(*args)
    prog = par._programs[signature_of(args)]
    low = Lowered(prog, plan, local_devices(par.cluster), loop_form=form)
    assert low.mode == "shard_map" and any(f >= 0 for f in plan.op_factors)  # uneven split
    got, want = low(*args), jax.jit(step)(*args)
    compare(hs.gather(got), want)
    got, want = low(*got[:2], *args[2:]), jax.jit(step)(*want[:2], *args[2:])
    compare(hs.gather(got), want)
    assert len(low.branch_loops) == (2 if form == "branch" else 0)
