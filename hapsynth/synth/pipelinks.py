"""What a candidate pipeline's stages send one another, in seconds over the links.

Per microbatch, each tensor crossing a boundary goes over the link between the two
groups of devices once (`crossings`); before the first tick, the parameters a stage
reads but does not store (tied embeddings) are copied to it (`parameter_copies`); after
the last, each stage receives the sums other stages made for its parameters
(`received`). Stages on one group of devices (a V shape) send each other nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hapsynth.cluster import Cluster
from hapsynth.synth.slots import wire_rounds
from hapsynth.synth.stagegroups import rows_of

__all__ = ["Placement", "placement", "Crossings", "crossings", "Copies", "parameter_copies",
           "received"]


@dataclass(frozen=True)
class Placement:
    """Where a candidate's stages run: `order[s]` the group of devices of stage s
    (`stage_groups`), `devices[s]` its devices, `rows[s]` the rows of a microbatch each
    holds; `place[s]` its group numbered 0, 1, ... where groups repeat (a V), else ()."""

    cluster: Cluster
    order: tuple[int, ...]
    devices: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[int, ...], ...]
    place: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.order)

    @property
    def members(self) -> list[list[int]]:
        """Per group of devices, its stages (one each unless groups repeat)."""
        if not self.place:
            return [[s] for s in range(self.stages)]
        return [[t for t in range(self.stages) if self.place[t] == j]
                for j in range(max(self.place) + 1)]

    def seconds(self, a: int, b: int, nbytes, scale=1) -> float:
        """Seconds to send `nbytes` (times `scale`) from stage a to stage b; none between
        stages on one group (held there)."""
        if nbytes <= 0 or self.order[a] == self.order[b]:
            return 0.0
        link = self.cluster.link_between(self.devices[a][0], self.devices[b][0])
        return link.alpha + scale * nbytes / link.beta


def placement(cluster: Cluster, groups, order, rows: int) -> Placement:
    """Stage s on `groups[order[s]]`, `rows` rows a microbatch. `order` may name a group
    twice (a V shape), never twice in a row (one stage)."""
    S = len(order)
    devices = tuple(groups[k] for k in order)
    gid = {k: i for i, k in enumerate(dict.fromkeys(order))}
    place = tuple(gid[k] for k in order) if len(gid) < S else ()
    if any(order[s] == order[s + 1] for s in range(S - 1)):
        raise ValueError(f"stages {order} next to each other on one group: one stage")
    return Placement(cluster, tuple(order), devices,
                     tuple(rows_of(cluster, devs, rows) for devs in devices), place)


@dataclass(frozen=True)
class Crossings:
    """Seconds of one microbatch's crossings: per boundary forward (`send`) and back
    (`send_back`), sent after the tick that made them; and `wire`, a tick's crossing
    where it is sent during the next tick (`lockstep`)."""

    send: list
    send_back: list
    wire: float


def crossings(at: Placement, send) -> Crossings:
    """`send[a, b, way]`: bytes of one microbatch stage a sends b, forward/backward. A
    transfer past the next stage is priced on its last hop; one between stages splitting
    rows otherwise is gathered over the sender's devices first."""
    S, order = at.stages, at.order
    fbytes = [sum(send[a, s + 1, 0] for a in range(s + 1) if order[a] != order[s + 1])
              for s in range(S - 1)]
    bbytes = [sum(send[b, s, 1] for b in range(s + 1, S) if order[b] != order[s])
              for s in range(S - 1)]
    scale = [1 if at.rows[s] == at.rows[s + 1] else len(at.devices[s]) for s in range(S - 1)]
    fw = [at.seconds(s, s + 1, fbytes[s], scale[s]) for s in range(S - 1)]
    bw = [at.seconds(s + 1, s, bbytes[s], scale[s]) for s in range(S - 1)]
    return Crossings(fw, bw, _wire(at, send))


def _wire(at: Placement, send) -> float:
    """A tick's crossing sent during the next tick: per shift between stages (skips too),
    every pair that ever sends on it crosses with the shift's widest message (gathered
    over the stage's devices first if any pair splits rows differently); one round after
    the other (`wire_rounds`)."""
    S, rows = at.stages, at.rows
    shift_s, pairs, gathered = {}, {}, set()
    for d in {b - a for a in range(S) for b in range(S) if a != b and send[a, b].any()}:
        pairs[d] = [(a, a + d) for a in range(S) if 0 <= a + d < S and send[a, a + d].any()]
        wide = max(send[a, b].max() for a, b in pairs[d])
        if any(rows[a] != rows[b] for a, b in pairs[d]):
            gathered.add(d)
        shift_s[d] = max(at.seconds(a, b, wide, len(at.devices[a]) if d in gathered else 1)
                         for a, b in pairs[d])
    return sum(max(shift_s[d] for d in rnd) for rnd in wire_rounds(pairs, gathered))


@dataclass(frozen=True)
class Copies:
    """The parameter copies before the first tick: `head`, seconds until the last is
    there (a link direction carrying its copies one by one); `ready`, free-running, per
    link direction as `pipeschedule.schedule` reads it, when its copies are there."""

    head: float
    ready: dict


def parameter_copies(at: Placement, graph, scan, free_running: bool) -> Copies:
    """The parameters each stage reads (`scan.needs`) but another stores (`scan.owner`),
    copied once a step, one buffer each."""
    S, order = at.stages, at.order
    copy = np.zeros((S, S))  # parameter bytes a -> b
    for s in range(S):
        for p in scan.needs[s]:
            if scan.owner[p] != s:
                copy[scan.owner[p], s] += graph.tensors[graph.inputs[p]].nbytes
    copied = {(a, b): at.seconds(a, b, copy[a, b]) for a in range(S) for b in range(S)
              if copy[a, b] > 0}
    on_link: dict = {}  # per direction of a link between groups, its copies one by one
    for (a, b), t in copied.items():
        on_link[order[a], order[b]] = on_link.get((order[a], order[b]), 0.0) + t
    ready: dict = {}  # free-running, the copies run under the first works, on their links
    for (a, b), t in copied.items() if free_running else ():
        key = ("F", b - 1) if a < b else ("B", b)
        ready[key] = max(ready.get(key, 0.0), on_link[order[a], order[b]])
    return Copies(max([0.0, *on_link.values()]), ready)


def received(at: Placement, once, s: int) -> float:
    """Seconds stage s receives what other stages send it once a step (`once[a, s]`
    bytes: the sums they made for its parameters)."""
    return sum(at.seconds(a, s, once[a, s]) for a in range(at.stages) if a != s)
