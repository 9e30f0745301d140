"""The once-per-step ops of a pipeline run free (the optimizer), a program per round and
stage, in the rounds `rounds.py` orders: what each round runs and returns (only what
another round or the step's outputs read; the rest stays inside its program), what it
reads that another stage made, and the donated state leaves it gives up; then what each
stage stores and outputs once the rounds ran, and where it fetches them from."""
from __future__ import annotations

from dataclasses import dataclass

from hapsynth.ir.trace import Const
from hapsynth.lower.rounds import post_rounds
from hapsynth.lower.wiring import StageWiring

__all__ = ["FreeRounds", "free_rounds"]


@dataclass(frozen=True, eq=False)
class FreeRounds:
    """Per round and stage with once-per-step ops, and per stage once they ran."""

    where: dict     # value -> (stage, round) making it (`rounds.Rounds`)
    level: dict     # once-per-step op -> its round
    rounds: dict    # (round, stage) -> (its ops, the values it returns)
    wants: dict     # (round, stage) -> [(value, stage making it)] made on other stages
    gone: dict      # (round, stage) -> the donated state leaves it gives up
    stores: dict    # stage -> the state leaves it stores
    results: list   # the step's outputs past its state, constants left out
    made_on: dict   # result -> the stage making it
    fetch: dict     # stage -> [(value, stage making it, or None: a state leaf passed through)]
    final: dict     # stage -> what it stores and outputs, by id


def free_rounds(w: StageWiring, donate: set, holders: list) -> FreeRounds:
    """`w`'s once-per-step ops in rounds. `donate`: the state leaves whose buffers the
    step may reuse; `holders[p]`: the stages reading state leaf p."""
    ranked = post_rounds(w)
    where, level, outs = ranked.where, ranked.level, w.prog.outputs
    rounds = _returned(w, level)
    wants = {(k, s): list(dict.fromkeys(
        (x, where[x][0]) for i in w.post[s] if level[i] == k for x in w.prog.eqns[i].inputs
        if isinstance(x, int) and x in where and where[x][0] != s)) for k, s in rounds}
    stores = {s: [p for p in range(w.nstate) if w.owner[p] == s] for s in range(w.S)}
    results = [o for o in outs[w.nstate:] if not isinstance(o, Const)]
    made_on = {o: where[o][0] if o in where else w.out_stage.get(o, 0) for o in results}
    # what its state leaves and outputs read from elsewhere once the rounds ran
    fetch = {s: [(o, where[o][0] if o in where else None) for o in dict.fromkeys(
        [outs[p] for p in stores[s]] + [o for o in results if made_on[o] == s])
        if isinstance(o, int) and (o in where and where[o][0] != s or o in w.leaf)]
        for s in range(w.S)}
    final = {s: list(dict.fromkeys([
        *[outs[p] for p in stores[s] if isinstance(outs[p], int)],
        *[o for o in results if made_on[o] == s]])) for s in range(w.S)}
    gone = _donated(w, rounds, where, final, donate, holders)
    return FreeRounds(where, level, rounds, wants, gone, stores, results, made_on, fetch, final)


def _returned(w: StageWiring, level: dict) -> dict:
    """Per (round, stage) with ops: (its ops, the values it returns, those another round
    or the step's outputs read)."""
    prog = w.prog
    readers: dict = {}  # per value, the rounds (level, stage) reading it
    for ids in w.post.values():
        for i in ids:
            for x in prog.eqns[i].inputs:
                if isinstance(x, int):
                    readers.setdefault(x, set()).add((level[i], w.stage[i]))
    outputs = {o for o in prog.outputs if isinstance(o, int)}
    rounds = {}
    for k in sorted(set(level.values())):
        for s in range(w.S):
            ops = [i for i in w.post[s] if level[i] == k]
            if ops:
                rounds[(k, s)] = (ops, [t for i in ops for t in prog.eqns[i].outputs
                                        if t in outputs or readers.get(t, set()) - {(k, s)}])
    return rounds


def _donated(w: StageWiring, rounds, where, final, donate, holders) -> dict:
    """Per round, the donated state leaves it gives up (`donate`): those its stage
    alone holds, read last by that round (through the state-only ops it runs), and
    neither stored nor output as they are."""
    kept = set()  # stored or output as they are, or read by what no round makes
    for o in (o for fin in final.values() for o in fin):
        if o in w.leaf:
            kept.add(o)
        elif o not in where and o in w.producer:
            kept |= _leaves_read(w, w.producer[o], set())
    last: dict = {}
    for (k, s), (ops, _) in sorted(rounds.items()):
        for t in set().union(*[_leaves_read(w, i, set()) for i in ops]):
            last[t] = (k, s)
    gone = {key: [] for key in rounds}
    for t, (k, s) in last.items():
        p = w.leaf[t]
        if p in donate and w.owner[p] == s and holders[p] == [s] and t not in kept:
            gone[(k, s)].append(t)
    return gone


def _leaves_read(w: StageWiring, i: int, seen: set) -> set:
    """The state leaves op i reads, itself or through the state-only ops it reads from
    (`seen`: those counted already)."""
    r, out = w.r, set()
    for x in w.prog.eqns[i].inputs:
        if not isinstance(x, int):
            continue
        if x in w.leaf:
            out.add(x)
        j = w.producer.get(x)
        if j is not None and j not in seen and (
                r.region[j] == "pre" or r.rank[j] < 0 and r.region[j] == "micro"):
            seen.add(j)
            out |= _leaves_read(w, j, seen)
    return out
