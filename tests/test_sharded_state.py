"""Sharded state chosen by the planner where replicated state does not fit, the FSDP
baseline, and per-device state measured from the live arrays against the plan."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import hapsynth as hs
from hapsynth.lower.program import Lowered
from hapsynth.models import get


def _cls(name: str, count: int, speed: int, memory: str) -> str:
    return (f'[[class]]\ntype = "CPU"\nname = "{name}"\ncount = {count}\nhost = 0\n'
            f'flops = "{90 * speed}GFLOP/s"\nmem_bandwidth = "{10 * speed}GB/s"\n'
            f'memory = "{memory}"\n')


def cluster(fast_bytes: int, slow_bytes: int) -> hs.Cluster:
    return hs.Cluster.from_toml(_cls("fast", 2, 4, f"{fast_bytes}B")
                                + _cls("slow", 6, 1, f"{slow_bytes}B"))


@pytest.fixture(scope="module")
def gpt():
    return get("gpt", "small", devices=8, batch=16)


@pytest.fixture(scope="module")
def roomy(gpt):
    step, args = gpt
    return hs.parallelize(step, cluster=cluster(2**36, 2**36), time_limit=2, devices="all",
                          remat=False, verbose=False).plan(*args)


def test_fsdp_baseline_shards_state_and_is_priced(roomy):
    """FSDP sits beside DP-EV and DP-CP, priced by the same model, holding less per device
    than data parallelism (its state is split over every device)."""
    assert {"DP-EV", "DP-CP", "FSDP"} <= set(roomy.baselines)
    assert 0 < roomy.baselines["FSDP"] < float("inf")
    assert roomy.baseline_memory["FSDP"] < roomy.baseline_memory["DP-EV"]
    assert "FSDP" in roomy.summary()
    assert hs.Plan.from_json(roomy.to_json()).baselines == roomy.baselines


def test_plan_memory_says_what_a_device_holds(roomy):
    """`plan.memory` per class: state, activations, collectives' buffers, their total and
    the capacity (the API contract's names)."""
    for m in roomy.memory.values():
        assert m["total"] == m["state"] + m["activations"] + m["buffers"]
        assert m["capacity"] == 2**36 and m["state"] > 0 and m["activations"] > 0


@pytest.mark.slow  # (~30 s: the search gives up on every start)
def test_fsdp_baseline_that_does_not_fit_says_so(gpt, roomy):
    step, args = gpt
    small = int(roomy.baseline_memory["FSDP"] * 0.5)
    try:
        plan = hs.parallelize(step, cluster=cluster(2 * small, small), time_limit=1, devices="all",
                              remat=False, verbose=False).plan(*args)
    except hs.InfeasibleMemory as err:
        assert "slow" in str(err)  # (names the class that binds)
        return
    assert plan.baselines["FSDP"] == float("inf")
    assert "FSDP -" in plan.summary() and "does not fit" in plan.summary()


def _jit_data_parallel(step, args, fsdp: bool = False):
    """`jax.jit(step)` as its own data parallelism over the 8 devices runs it: the batch
    split, the state replicated, or (`fsdp`) each state leaf split on its largest dim where
    8 divides it (MaxText's fsdp axis: XLA's own ZeRO-3). How far these land from one
    device is the tolerance."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, PS("d"))), args[2])

    def placed(x):
        d = int(np.argmax(x.shape)) if x.ndim else 0
        split = fsdp and x.ndim and x.shape[d] % 8 == 0
        return NamedSharding(mesh, PS(*[None] * d, "d") if split else PS())

    where = jax.tree.map(placed, args[:2])
    fn = jax.jit(step, out_shardings=(*where, NamedSharding(mesh, PS())))
    return lambda *state: fn(*jax.device_put(state, where), batch, *args[3:])


def _max_error(a, b) -> list[float]:
    return [float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]


def held_bytes(tree) -> dict:
    """Bytes per device of the live arrays in `tree`, from their addressable shards."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, hs.Sharded)):
        data = leaf.data if isinstance(leaf, hs.Sharded) else leaf
        for s in data.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def test_planner_shards_state_where_replicated_state_does_not_fit(gpt, roomy):
    """Memory below data parallelism's need: the planner shards the state by itself, the
    plan fits, three steps equal one-device `jax.jit` within what `jax.jit`'s own data
    parallelism gives, and each device holds no more state than planned."""
    step, args = gpt
    cap = int((roomy.baseline_memory["FSDP"] + min(roomy.baseline_memory["DP-EV"],
                                                    roomy.baseline_memory["DP-CP"])) / 2)
    par = hs.parallelize(step, cluster=cluster(2 * cap, cap), time_limit=2, devices="all",
                         remat=False, verbose=False)
    plan = par.plan(*args)
    replicated = sum(x.nbytes for x in jax.tree.leaves(args[:2]))
    assert all(plan.baseline_memory[k] > cap for k in ("DP-EV", "DP-CP"))
    assert plan.memory["slow"]["total"] <= cap
    assert plan.memory["slow"]["state"] < replicated / 2  # (sharded without being told)

    got = _three_steps_match_jit(par, step, args)
    held = held_bytes(got[:2])
    assert len(held) == 8
    for d, nbytes in held.items():
        assert nbytes <= plan.memory["fast" if d.id < 2 else "slow"]["state"]
    assert plan.breakdown["prefetched_comm"] > 0
    # the same plan as one shard_map program (as on uneven shares) gathers one ahead
    low = par.lowered(*args)
    low = Lowered(low.prog, low.plan, jax.devices(), gspmd=False)
    _gathered_one_ahead(low, args)
    _three_steps_match_jit(low, step, args, slack=8.0)  # (see the strict test below)


def _gathered_one_ahead(low, args) -> None:
    """In the program, each gather of stored state (or of checkpointing's copy of it: an
    all-gather, or the masked psum of the grouped form) comes before the first branch
    that reads the previous one: it is issued while that one's reader runs (as priced)."""
    assert low.mode == "shard_map" and len(low.ahead) > 1
    closed = jax.make_jaxpr(low._fn)(*low._stored(jax.tree.leaves(args)))
    body = next(e for e in _eqns(closed.jaxpr) if e.primitive.name == "shard_map")
    eqns = body.params["jaxpr"].eqns
    stored = {v for v, lay in zip(body.params["jaxpr"].invars, low.in_layouts)
              if lay.kind == "S"}
    src, made, gathers, first_reader = {}, {}, [], {}
    for i, e in enumerate(eqns):
        ins = [v for v in e.invars if not hasattr(v, "val")]
        mine = set().union(*(made.get(v, set()) for v in ins))
        name = e.primitive.name
        if name == "cond":
            for g in mine:
                first_reader.setdefault(g, i)
            continue
        if name == "optimization_barrier":  # checkpointing's copies of state
            stored |= {y for x, y in zip(e.invars, e.outvars) if x in stored}
        from_state = any(v in stored or src.get(v) for v in ins)
        if name in ("all_gather", "psum") and from_state:
            gathers.append(i)
            mine, from_state = {i}, False
        for v in e.outvars:
            made[v], src[v] = mine, from_state
    assert len(gathers) > 1 and low.issued_ahead
    for prev, nxt in zip(gathers, gathers[1:]):
        if prev in first_reader:
            assert nxt < first_reader[prev], (prev, nxt, first_reader[prev])


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        if "jaxpr" in e.params and hasattr(e.params["jaxpr"], "eqns"):
            yield from _eqns(e.params["jaxpr"])
        elif "jaxpr" in e.params and hasattr(e.params["jaxpr"], "jaxpr"):
            yield from _eqns(e.params["jaxpr"].jaxpr)


def _three_steps_match_jit(par, step, args, slack: float = 1.25):
    """Three steps of `par` equal one-device `jax.jit` within what `jax.jit`'s own data
    parallelism over the same devices gives (times `slack`), state replicated or split as
    FSDP (XLA's own ZeRO-3 lands further from one device: on 146 of the small GPT's 157
    leaves after three steps); returns the last step's results."""
    ref = jax.jit(step)
    dps = [_jit_data_parallel(step, args), _jit_data_parallel(step, args, fsdp=True)]
    want, got = args[:2], args[:2]
    theirs = [args[:2]] * len(dps)
    eps = float(np.finfo(np.float32).eps)
    for _ in range(3):
        want = ref(*want[:2], *args[2:])
        theirs = [dp(*state[:2]) for dp, state in zip(dps, theirs)]
        got = par(*got[:2], *args[2:])
        tol = np.max([_max_error(state[:2], want[:2]) for state in theirs], axis=0)
        ours = _max_error(hs.gather(got[:2]), want[:2])
        scales = [max(float(np.max(np.abs(np.asarray(w)))), 1.0) for w in jax.tree.leaves(want[:2])]
        worse = [(k, e, t) for k, (e, t, s) in enumerate(zip(ours, tol, scales))
                 if e > max(slack * t, 4 * eps * s)]  # (rounding: within 6% here)
        assert not worse, f"leaves further from one device than jit's data parallelism: {worse}"
    return got


def test_forced_zero3_matches_jit_and_holds_its_shard(gpt):
    """`strategy="fsdp"`: parameters, gradients and optimizer state sharded evenly (ZeRO-3)
    on a 2 + 6 cluster; three steps equal one-device `jax.jit` within what `jax.jit`'s own
    data parallelism gives, and each device holds its even shard of the state."""
    step, args = gpt
    par = hs.parallelize(step, cluster=cluster(2**36, 2**36), strategy="fsdp", verbose=False)
    plan = par.plan(*args)
    assert plan.chosen == "FSDP" and plan.predicted_step_time == plan.baselines["FSDP"]
    replicated = sum(x.nbytes for x in jax.tree.leaves(args[:2]))
    got = _three_steps_match_jit(par, step, args)
    held = held_bytes(got[:2])
    assert len(held) == 8
    for d, nbytes in held.items():
        assert nbytes <= plan.memory["fast" if d.id < 2 else "slow"]["state"]
        assert nbytes < replicated / 4  # (sharded: an eighth and what is too small to split)


@pytest.fixture(scope="module")
def segmented(gpt):
    """Memory below what recomputing the cheap activations needs (5 MiB a slow device)."""
    step, args = gpt
    cap = 5 * 2**20
    par = hs.parallelize(step, cluster=cluster(2 * cap, cap), time_limit=2, devices="all",
                         verbose=False)
    return par, par.plan(*args), cap


def test_too_big_for_cheap_recomputation_the_planner_checkpoints_by_segments(gpt, segmented):
    """The planner recomputes the forward pass segment by segment (contractions too) with
    the state sharded; the plan fits, runs equal to `jax.jit` (within 8x what `jax.jit`'s
    own data parallelism gives: see the strict test below), and no device holds more
    state than planned."""
    step, args = gpt
    par, plan, cap = segmented
    assert plan.remat["target"] == "segments", plan.summary()
    assert "checkpointed by segments" in plan.summary()
    assert plan.memory["slow"]["total"] <= cap
    got = _three_steps_match_jit(par, step, args, slack=8.0)
    for d, nbytes in held_bytes(got[:2]).items():
        assert nbytes <= plan.memory["fast" if d.id < 2 else "slow"]["state"]
    low = par.lowered(*args)
    copies = [e for e in low.prog.eqns if getattr(e.primitive, "name", "") == "optimization_barrier"
              and set(e.inputs) & set(low.prog.inputs[:plan.state_leaves])]
    assert copies and plan.breakdown["prefetched_comm"] > 0
    _gathered_one_ahead(Lowered(low.prog, plan, jax.devices(), gspmd=False), args)
    again = hs.Plan.from_json(plan.to_json())
    assert again == plan
    # a saved plan redoes the rewrite on the traced step and is checked against it
    assert hs.parallelize(step, cluster=cluster(2 * cap, cap), plan=again,
                          verbose=False).plan(*args) is again


@pytest.mark.slow  # (three more steps of the same plan)
@pytest.mark.xfail(strict=True, reason="known gap (issue 49, docs/limits.md): the shard_map "
                   "program lands up to ~8x further from one device than jit's own data "
                   "parallelism, a plan recomputing by segments too")
def test_checkpointed_plan_within_jit_data_parallel_tolerance(gpt, segmented):
    step, args = gpt
    _three_steps_match_jit(segmented[0], step, args)


@pytest.mark.parametrize("model,config,setup", [
    ("gpt", "small", "one device"), ("vit", "small", "2+6 data-parallel")])
def test_predicted_memory_is_within_a_quarter_of_xla(model, config, setup):
    """The predicted bytes per device against XLA's `memory_analysis()` of the lowered
    program (state donated): within 25% (benchmarks/memory_check.py gives every zoo
    config; those outside are named in RESULTS.md)."""
    from hapsynth_bench.memory_check import measure

    predicted, xla, _ = measure(model, config, setup)
    assert 0.75 <= predicted / xla <= 1.25, (predicted, xla)


@pytest.mark.slow  # (~20 s: a plan and one more compile)
def test_sharded_plan_memory_is_within_a_quarter_of_xla(gpt, roomy):
    """With the state sharded (its gradients reduce-scattered, its parameters gathered for
    their readers), the predicted bytes per device are within 25% of XLA's
    `memory_analysis()` of the lowered program, state donated."""
    step, args = gpt
    cap = int((roomy.baseline_memory["FSDP"] + min(roomy.baseline_memory["DP-EV"],
                                                    roomy.baseline_memory["DP-CP"])) / 2)
    par = hs.parallelize(step, cluster=cluster(2 * cap, cap), time_limit=2, devices="all",
                         remat=False, verbose=False, donate_argnums=(0, 1))
    plan = par.plan(*args)
    assert plan.memory["slow"]["state"] < sum(x.nbytes for x in jax.tree.leaves(args[:2])) / 2
    low = par.lowered(*args)
    m = low._fn.lower(*low._stored(jax.tree.leaves(args))).compile().memory_analysis()
    xla = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
    assert 0.75 <= plan.memory["slow"]["total"] / xla <= 1.25, (plan.memory["slow"], xla)
