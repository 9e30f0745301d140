"""One group's work in one tick of a pipelined program: its stage's forward or backward
ops at the group's rows of one microbatch, reading what its forward kept and what other
stages sent; returning what it adds to its sums, keeps and sends."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from hapsynth.lower.packing import Ref, pad_to, trim
from hapsynth.lower.place import DATA
from hapsynth.lower.ticklayout import TickLayout
from hapsynth.lower.wiring import StageWiring

__all__ = ["tick_branch"]


def _slot(bufs, k):
    return tuple(lax.dynamic_index_in_dim(b, k, 0, keepdims=False) for b in bufs)


def tick_branch(w: StageWiring, lay: TickLayout, g, ph, m, state, data, pool, mail,
                keeping):
    """The work of group g's devices in phase `ph` ("F" or "B") on microbatch `m`, as a
    switch branch. Operands: the keep slot a backward reads (of `pool`) and per channel
    the mailbox slot to read (of `mail`); results: what it adds to its phase's sums, what
    the forward keeps (if `keeping`), what each shift's wire sends (zeros where nothing
    is). `state`: per stage, its state values by tensor id."""
    s, rows = lay.groups[g]

    def branch(*ops):
        known, env = _known(w, lay, s, rows, ph, state[s], data, pool, mail, ops), {}
        run = w._evaluator(s, rows, m, env, lambda x: known[x])
        for i in w.core[(s, ph)]:
            run(i)
        return _results(w, lay, s, ph, env, known, keeping)

    return branch


def _known(w, lay, s, rows, ph, state, data, pool, mail, ops) -> dict:
    """What stage s's phase reads besides its own ops: its state, what its forward kept,
    what it received, the data."""
    mails = {c: (mail[c], ops[1 + j]) for j, c in enumerate(lay.chans)}
    known = dict(state)
    if ph == "B" and w.keeps[s]:
        for t, v in lay.keep_packing[s].unpack(_slot(pool, ops[0]),
                                               tuple(lay.keep_sizes)).items():
            known[t] = trim(v, w.plan.tensor_layouts[t], w._local(t, rows))
    for (a, pha), dests in w.sends.items():
        if (s, ph) in dests:
            c = (s - a, pha)
            bufs = _slot(*mails[c])
            ref = Ref(bufs, tuple(lay.chan_sizes[c]), lay.chan_pack[c][a], lay.chunked[c[0]], a)
            known.update(_received(w, lay, ref, bufs, s, rows))
    known.update({t: data[t] for t in w.data})
    return known


def _results(w, lay, s, ph, env, known, keeping) -> tuple:
    """A tick branch's results, each buffer padded to its largest branch's."""
    lays = w.plan.tensor_layouts
    sums = lay.acc_packing[ph][s]
    out = sums.pack({t: env[t] for t in sums.slots}, lay.acc_sizes[ph])
    if keeping:
        out += lay.keep_packing[s].pack({
            t: pad_to(env[t] if t in env else known[t], lays[t], w._padded(t, s))
            for t in w.keeps[s]}, lay.keep_sizes)
    for d in lay.shifts:
        p = lay.chan_pack.get((d, ph), {}).get(s)
        out += p.pack({key: pad_to(env[key[2]], lays[key[2]], w._padded(key[2], s))
                       for key in p.slots}, lay.wire_sizes[d]) if p is not None else tuple(
            jnp.zeros((n,), k) for k, n in lay.wire_sizes[d].items())
    return out


def _received(w, lay, ref, bufs, s, rows) -> dict:
    """Values of `ref` (sent by stage `ref.sender`) as this device of stage `s` reads them."""
    prog, lays = w.prog, w.plan.tensor_layouts
    out = {}
    if not ref.chunked:
        for key, v in ref.packing.unpack(bufs, ref.order).items():
            t = key[2]
            out[t] = trim(v, lays[t], w._local(t, rows))
        return out
    didx = lax.axis_index(DATA)
    chunks = [ref.packing.unpack(tuple(b[j] for b in bufs), ref.order)
              for j in range(lay.stage_devices)]
    a = ref.sender
    off = jnp.asarray(w._offsets(s))[didx]
    for key in ref.packing.slots:
        t = key[2]
        if lays[t].kind != "S":
            out[t] = jnp.stack([c[key] for c in chunks])[didx]
            continue
        whole = jnp.concatenate([trim(c[key], lays[t], w._local(t, w.rows[a][j]))
                                 for j, c in enumerate(chunks)], axis=lays[t].dim)
        scale = prog.avals[t].shape[lays[t].dim] // w.r.batch
        out[t] = lax.dynamic_slice_in_dim(whole, off * scale, rows * scale, axis=lays[t].dim)
    return out
