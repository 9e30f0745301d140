"""Per-device memory of an assignment: state (params + optimizer) plus peak activations
plus the buffers collectives make.

Sharded tensors are stored padded to the largest shard (docs/design.md, stage 3), so
a sharded tensor costs every device `max(units) * bytes / units_total`, whatever
its own share: per-device memory is the same on every device, and the class with
the least memory is the one that binds. Activations: every tensor is live from its
producer to its last reader (outputs to the end), unless XLA fuses it into its one
reader (`Tensor.fused`: never held); the peak over program order counts.
Buffers: an all-gather's result is a new, larger value beside its shard (a parameter
stored sharded and gathered for its readers), live from its first reader to its last;
an all-reduce works in place of its partial sum; a reduce-scatter frees the partial
sum, leaving its shard (a gradient reduce-scattered to a sharded update is held whole
only until then).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hapsynth.ir.layout import R
from hapsynth.synth.collectives import ALL_GATHER, REDUCE_SCATTER
from hapsynth.synth.pricing import Tables


@dataclass(frozen=True)
class Memory:
    """Bytes on every device (sharded tensors are stored padded, so all devices alike)."""

    state: float        # parameters and optimizer state
    activations: float  # live intermediates at the peak
    buffers: float      # collectives' results (all-gathered values) live at the peak
    total: float
    peak_op: int        # the op after which the peak occurs


def layout_bytes(tables: Tables, layout, nbytes: float) -> float:
    if layout.sharded:
        return max(tables.pricer.units(layout.units)) * nbytes / layout.units
    return float(nbytes)


def gathered_bytes(tables: Tables, edge) -> np.ndarray:
    """Per strategy of `edge`'s producer: bytes of the buffer its conversion makes (an
    all-gather's result; 0 where the conversion works in place or is not needed)."""
    nbytes = tables.structure.graph.tensors[edge.tensor].nbytes
    full = layout_bytes(tables, edge.need, nbytes)
    return np.array([full if edge.conversions.get(lay, ("none",))[0] == ALL_GATHER else 0.0
                     for lay in edge.layouts])


class MemoryModel:
    """Liveness intervals per (node, strategy), priced once per set of shares."""

    def __init__(self, tables: Tables):
        st = tables.structure
        g = st.graph
        n_ops = len(g.ops)
        loop_end: dict[int, int] = {}
        for op in g.ops:
            if op.loop is not None:
                loop_end[op.loop] = op.id
        last_use: dict[int, int] = {}
        for op in g.ops:
            for t in op.inputs:
                if t is None:
                    continue
                end = op.id
                made_by = g.tensors[t].producer
                if made_by is not None and made_by > op.id:  # a carry, read next iteration
                    end = loop_end[g.ops[made_by].loop]
                last_use[t] = max(last_use.get(t, -1), end)
        outputs = {t for t in g.outputs if t is not None}
        state = set(st.pairs.values())
        self.n_ops = n_ops
        # per node and strategy: (state bytes, birth positions, death positions, bytes)
        self.rows = []
        for node in g.nodes:
            made = [(t, op_id) for op_id in node.ops for t in g.ops[op_id].outputs
                    if (t in last_use or t in outputs) and not g.tensors[t].fused]
            per = []
            for strat in st.strategies[node.id]:
                sb, births, deaths, sizes = 0.0, [], [], []
                for t, op_id in made:
                    b = layout_bytes(tables, strat.layouts.get(t, R), g.tensors[t].nbytes)
                    if t in state:
                        sb += b
                    else:
                        births.append(op_id)
                        deaths.append(n_ops if t in outputs else last_use[t] + 1)
                        sizes.append(b)
                per.append((sb, np.array(births, int), np.array(deaths, int), np.array(sizes)))
            self.rows.append(per)
        self.gathers = _Gathers(tables, n_ops)
        ends = {t: n_ops if t in outputs else last_use[t] + 1 for t in last_use}
        ends.update({t: n_ops for t in outputs})
        self.scatters = _Scatters(tables, ends, state)

    def profile(self, assign) -> tuple[float, np.ndarray, np.ndarray]:
        """(state bytes, live activation bytes after each op, live buffer bytes after each
        op)."""
        diff = np.zeros(self.n_ops + 1)
        state = 0.0
        for n, s in enumerate(assign):
            sb, b, d, z = self.rows[n][s]
            state += sb
            np.add.at(diff, b, z)
            np.add.at(diff, d, -z)
        self.scatters.apply(assign, diff)
        held = self.gathers.live(assign, self.n_ops)
        return state, np.cumsum(diff)[:-1], held

    def per_device(self, assign) -> Memory:
        state, live, held = self.profile(assign)
        both = live + held
        peak = int(np.argmax(both)) if len(both) else 0
        act = float(live[peak]) if len(live) else 0.0
        buf = float(held[peak]) if len(held) else 0.0
        return Memory(state, act, buf, state + act + buf, peak)

    def total(self, assign) -> float:
        return self.per_device(assign).total

    def constraint_rows(self, assign) -> list[tuple[int, list[float]]]:
        """The solver's memory constraint: (node, bytes per strategy) at the assignment's
        peak op, state included (a gathered buffer live there counts on its producer's
        row, as long as its readers stay as they are)."""
        p = self.per_device(assign).peak_op
        extra = self.gathers.at(assign, p)
        for n, x in self.scatters.at(assign, p).items():
            extra[n] = extra.get(n, 0.0) - x
        out = []
        for n, per in enumerate(self.rows):
            vals = [sb + float(z[(b <= p) & (d > p)].sum()) for sb, b, d, z in per]
            if n in extra:
                vals = [v + float(x) for v, x in zip(vals, extra[n])]
            if any(vals):
                out.append((n, vals))
        return out


class _Scatters:
    """Partial sums reduce-scattered (a gradient on its way to a sharded update, ZeRO-2's
    form): the full partial lives until its reduce-scatter, the shard it leaves from
    then on. As arrays: per edge and producer strategy, the bytes freed, from where to
    the tensor's end; it counts where every conversion of the tensor the assignment needs
    is a reduce-scatter (the partial is freed once all are made; their shards stay)."""

    def __init__(self, tables: Tables, ends: dict, state: set):
        graph = tables.structure.graph
        edges = tables.edges
        tensors = sorted({e.tensor for e in edges})
        index = {t: i for i, t in enumerate(tensors)}
        self.n_tensors = len(tensors)
        self.of = np.array([index[e.tensor] for e in edges], int)
        self.always_all = np.array([-1 in e.consumers for e in edges], bool)
        pairs = [(k, n, s_) for k, e in enumerate(edges)
                 for n, ss in e.consumers.items() if n >= 0 for s_ in ss]
        self.p_edge, self.p_node, self.p_strategy = (np.array(x, int) for x in (
            zip(*pairs) if pairs else ((), (), ())))
        rows = []
        for k, e in enumerate(edges):
            t = e.tensor
            if t in state or t not in ends or e.position + 1 >= ends[t]:
                continue
            nbytes = graph.tensors[t].nbytes
            kept = layout_bytes(tables, e.need, nbytes)
            freed = np.array([float(nbytes) if lay.partial and e.conversions.get(
                lay, ("",))[0] == REDUCE_SCATTER else 0.0 for lay in e.layouts])
            if freed.any():
                rows.append((k, e.src, freed, e.position + 1, ends[t], kept))
        width = max((len(r[2]) for r in rows), default=1)
        self.edge = np.array([r[0] for r in rows], int)
        self.src = np.array([r[1] for r in rows], int)
        self.full = np.zeros((len(rows), width))  # per producer strategy: the partial's bytes
        for i, r in enumerate(rows):
            self.full[i, :len(r[2])] = r[2]
        self.start = np.array([r[3] for r in rows], int)
        self.end = np.array([r[4] for r in rows], int)
        self.kept = np.array([r[5] for r in rows], float)

    def sizes(self, assign) -> np.ndarray:
        if not len(self.src):
            return np.zeros(0)
        a = np.asarray(assign)
        hit = a[self.p_node] == self.p_strategy
        needed = self.always_all | (np.bincount(self.p_edge[hit], minlength=len(self.of)) > 0)
        full = self.full[np.arange(len(self.src)), a[self.src]]
        mine = needed[self.edge] & (full > 0)
        per_tensor = np.bincount(self.of[needed], minlength=self.n_tensors)
        scattered = np.bincount(self.of[self.edge[mine]], minlength=self.n_tensors)
        t = self.of[self.edge]
        every = mine & (per_tensor[t] == scattered[t])
        share = full / np.maximum(scattered[t], 1) - self.kept
        return np.where(every, np.maximum(share, 0.0), 0.0)

    def apply(self, assign, diff: np.ndarray) -> None:
        """Take the freed bytes off `diff` (per op, before the cumulative sum)."""
        z = self.sizes(assign)
        ok = z > 0
        np.add.at(diff, self.start[ok], -z[ok])
        np.add.at(diff, self.end[ok], z[ok])

    def at(self, assign, p: int) -> dict[int, np.ndarray]:
        """Per producer node: bytes freed per its strategy at op `p`."""
        z = self.sizes(assign)
        out: dict[int, np.ndarray] = {}
        for k in np.flatnonzero((z > 0) & (self.start <= p) & (p < self.end)):
            out[int(self.src[k])] = out.get(int(self.src[k]), 0.0) + self.full[k] - self.kept[k]
        return out


class _Gathers:
    """The all-gathers' buffers of `tables`' edges, as arrays: which producer strategy
    makes one and of what size, and which consumer strategies need it, reading it from
    which op to which (so an assignment's live buffers are a few array operations). A
    buffer lives from the first op that reads it to the last, among the consumers that
    need it under the assignment: a parameter gathered for the forward pass and gathered
    again for the backward is two buffers, not one held in between. Stored state's
    buffers are made one gather ahead (`timing.py`): from the previous such buffer's
    first reader on."""

    def __init__(self, tables: Tables, n_ops: int):
        rows = [(e, gathered_bytes(tables, e)) for e in tables.edges]
        rows = [(e, b) for e, b in rows if b.any()]
        width = max((len(b) for _, b in rows), default=1)
        self.n_ops = n_ops
        self.src = np.array([e.src for e, _ in rows], int)
        self.bytes = np.zeros((len(rows), width))
        for k, (_, b) in enumerate(rows):
            self.bytes[k, :len(b)] = b
        self.position = np.array([e.position for e, _ in rows], int)
        self.deferred = np.array([e.deferred for e, _ in rows], bool)
        self.prefetch = np.array([e.prefetch for e, _ in rows], bool)
        self.avail = np.array([e.avail for e, _ in rows], int)
        self.end = np.array([min(e.last, n_ops - 1) + 1 for e, _ in rows], int)
        self.always = np.array([-1 in e.consumers for e, _ in rows], bool)
        pairs = [(k, n, s_, *e.spans.get(n, (e.position, e.last)))
                 for k, (e, _) in enumerate(rows)
                 for n, ss in e.consumers.items() if n >= 0 for s_ in ss]
        self.edge, self.node, self.strategy, self.first, self.last = (np.array(x, int) for x in (
            zip(*pairs) if pairs else ((), (), (), (), ())))

    def spans(self, assign) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per edge under `assign`: the bytes of its buffer (0: none made or not needed),
        the op it is made before and the op after which it is freed."""
        m = len(self.src)
        if not m:
            return np.zeros(0), np.zeros(0, int), np.zeros(0, int)
        a = np.asarray(assign)
        hit = a[self.node] == self.strategy
        birth = np.full(m, self.n_ops, int)
        death = np.where(self.always, self.end, 0)
        np.minimum.at(birth, self.edge[hit], self.first[hit])
        np.maximum.at(death, self.edge[hit], np.minimum(self.last[hit], self.n_ops - 1) + 1)
        birth = np.where(self.deferred | self.always, np.minimum(birth, self.position), birth)
        needed = self.always | (np.bincount(self.edge[hit], minlength=m) > 0)
        z = np.where(needed, self.bytes[np.arange(m), a[self.src]], 0.0)
        ahead = np.flatnonzero(self.prefetch & (z > 0))
        if len(ahead):  # gathered one ahead: from the previous one's first reader on
            ahead = ahead[np.argsort(birth[ahead], kind="stable")]
            birth[ahead] = np.maximum(np.concatenate([[0], birth[ahead[:-1]]]),
                                      self.avail[ahead] + 1)
        return z, birth, death

    def sizes(self, assign) -> np.ndarray:
        return self.spans(assign)[0]

    def live(self, assign, n_ops: int) -> np.ndarray:
        """Buffer bytes live after each op."""
        held = np.zeros(n_ops + 1)
        z, birth, death = self.spans(assign)
        ok = (z > 0) & (birth < death)
        np.add.at(held, birth[ok], z[ok])
        np.add.at(held, death[ok], -z[ok])
        return np.cumsum(held)[:-1]

    def at(self, assign, p: int) -> dict[int, np.ndarray]:
        """Per producer node: bytes per its strategy of the buffers live at op `p` (as long
        as their readers stay as they are)."""
        z, birth, death = self.spans(assign)
        out: dict[int, np.ndarray] = {}
        for k in np.flatnonzero((z > 0) & (birth <= p) & (p < death)):
            out[int(self.src[k])] = out.get(int(self.src[k]), 0.0) + self.bytes[k]
        return out
