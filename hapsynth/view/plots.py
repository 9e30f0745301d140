"""Pictures of plans (matplotlib, the `hapsynth[plot]` extra). Each function draws from the
plan's own numbers and returns the Figure; bars carry their kind as the label of their
container, so a picture can be checked against the plan it shows."""
from __future__ import annotations

from hapsynth.synth.timeline import SYNC

COLORS = {"compute": "#4c72b0", "idle": "#d9d9d9", "collective": "#dd8452", "wait": "#c44e52",
          "sync": "#55a868", "prefetch": "#64b5cd", "tail": "#8172b3"}
KINDS = ("compute", "idle", "collective", "wait", "sync", "prefetch")
LABELS = {"sync": "gradient sync", "prefetch": "state gathered ahead"}


def _figure(**kw):
    """A new Figure, not registered with pyplot: no global state, nothing left open."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'hapsynth[plot]'") from err
    return Figure(layout="constrained", **kw)


def _axes(ax, size):
    if ax is not None:
        return ax.figure, ax
    fig = _figure(figsize=size)
    return fig, fig.subplots()


def _lanes(plan) -> list[str]:
    return [*plan.classes, *([SYNC] if any(s.lane == SYNC for s in plan.timeline) else [])]


def plot_timeline(plan, ax=None):
    """One step as a Gantt chart: a row per device class (compute per segment, idle while
    the slowest class works, inline collectives, sync not hidden, the tail), and a row for
    the gradient sync overlapping the backward pass."""
    if not plan.timeline:
        raise ValueError("this plan has no timeline (saved by an older hapsynth): re-plan it")
    lanes = _lanes(plan)
    fig, ax = _axes(ax, (10, 1.0 + 0.5 * len(lanes)))
    row = {name: i for i, name in enumerate(lanes)}
    scale, unit = _unit(plan.predicted_step_time)
    for kind in KINDS:
        spans = [s for s in plan.timeline if s.kind == kind]
        if spans:
            ax.barh([row[s.lane] for s in spans], [s.seconds * scale for s in spans],
                    left=[s.start * scale for s in spans], height=0.6, color=COLORS[kind],
                    label=LABELS.get(kind, kind), edgecolor="none")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel(f"time in one step ({unit})")
    ax.axvline(plan.predicted_step_time * scale, color="black", lw=0.8)
    ax.set_title(f"{plan.cluster}: predicted step {plan.predicted_step_time * scale:.4g} {unit} "
                 f"({_limit(plan):.0%} of the limit)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.05 * len(lanes)), ncol=5,
              frameon=False)
    return fig


def plot_balance(plan, ax=None):
    """Busy and idle seconds per device class in one step: the plan beside DP-EV and DP-CP
    (what each class does while the slowest finishes)."""
    rows = [("plan", plan.predicted_step_time, plan.breakdown["compute_per_class"])]
    rows += [(k, plan.baselines[k], (plan.baseline_busy or {}).get(k))
             for k in ("DP-EV", "DP-CP") if k in plan.baselines]
    rows = [r for r in rows if r[2] is not None]
    fig, ax = _axes(ax, (8, 1.0 + 0.35 * len(plan.classes) * len(rows)))
    scale, unit = _unit(max(r[1] for r in rows))
    labels, busy, idle = [], [], []
    for c in plan.classes:
        for name, step, per in rows:
            labels.append(f"{c} · {name}")
            busy.append(per[c] * scale)
            idle.append((step - per[c]) * scale)
    y = range(len(labels))
    ax.barh(y, busy, color=COLORS["compute"], label="busy", height=0.7)
    ax.barh(y, idle, left=busy, color=COLORS["idle"], label="idle (waits for the slowest)",
            height=0.7)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds of one step ({unit})")
    ax.set_title(f"busy and idle per class on {plan.cluster}: the plan beside data parallelism")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.4 / len(labels)), ncol=2,
              frameon=False)
    return fig


def plot_plans(plans, labels=None, ax=None):
    """Several plans side by side (e.g. one model on several clusters): the predicted step,
    DP-EV, DP-CP and the ideal of each, with the plan's fraction of the limit."""
    plans = list(plans)
    labels = list(labels) if labels is not None else [p.cluster for p in plans]
    if len(labels) != len(plans):
        raise ValueError(f"{len(plans)} plans but {len(labels)} labels")
    kinds = ("plan", "DP-EV", "DP-CP", "ideal")
    fig, ax = _axes(ax, (8, 1.0 + 0.9 * len(plans)))
    scale, unit = _unit(max(max(_value(p, k) or 0 for k in kinds) for p in plans))
    h = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        ys = [i + (j - 1.5) * h for i, p in enumerate(plans) if _value(p, kind) is not None]
        xs = [_value(p, kind) * scale for p in plans if _value(p, kind) is not None]
        ax.barh(ys, xs, height=h, label=kind,
                color=("#4c72b0", "#dd8452", "#937860", "#55a868")[j])
    ax.set_yticks(range(len(plans)),
                  [f"{lab}\n{_limit(p):.0%} of limit" for lab, p in zip(labels, plans)])
    ax.invert_yaxis()
    ax.set_xlabel(f"predicted seconds per step ({unit})")
    ax.legend(loc="lower right", frameon=False)
    return fig


def plot_schedule(sched, ax=None):
    """A pipeline schedule (`synth.pipeschedule.PipeSchedule`): a row per stage, each
    microbatch's forward (light) and backward (dark) labelled by its number."""
    fig, ax = _axes(ax, (10, 1.0 + 0.5 * sched.stages))
    scale, unit = _unit(sched.makespan)
    for phase, color, label in (("F", "#a1c9f4", "forward"), ("B", "#4c72b0", "backward")):
        slots = [s for s in sched.slots if s.phase == phase]
        bars = ax.barh([s.stage for s in slots], [(s.end - s.start) * scale for s in slots],
                       left=[s.start * scale for s in slots], height=0.6, color=color,
                       edgecolor="white", label=label)
        for s, bar in zip(slots, bars):
            ax.text(bar.get_x() + bar.get_width() / 2, s.stage, str(s.micro), ha="center",
                    va="center", fontsize=7, color="black" if phase == "F" else "white")
    ax.set_yticks(range(sched.stages), [f"stage {s}" for s in range(sched.stages)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(f"{sched.kind}: {sched.micros} microbatches, step {sched.makespan * scale:.4g} "
                 f"{unit}, bubble {sched.bubble():.0%}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    return fig


def overview(plan):
    """The timeline (a pipeline: its schedule) above the balance, in one Figure (what
    `hapsynth plan --png` writes)."""
    lanes = len(plan.stages) if plan.stages else len(_lanes(plan))
    rows = len(plan.classes) * (1 + sum(k in plan.baselines for k in ("DP-EV", "DP-CP")))
    fig = _figure(figsize=(10, 2.5 + 0.5 * lanes + 0.3 * rows))
    top, bottom = fig.subplots(2, 1, height_ratios=[1 + lanes, 1 + rows])
    if plan.stages:
        plot_schedule(plan.schedule(), ax=top)
        top.set_yticks(range(len(plan.stages)),
                       [f"{k}: {st['island']}" for k, st in enumerate(plan.stages)])
    else:
        plot_timeline(plan, ax=top)
    plot_balance(plan, ax=bottom)
    return fig


def _value(plan, kind):
    return plan.predicted_step_time if kind == "plan" else plan.baselines.get(kind)


def _limit(plan) -> float:
    return plan.baselines["ideal"] / plan.predicted_step_time


def _unit(seconds: float):
    """(scale, unit) so that `seconds * scale` reads well."""
    for scale, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "µs")):
        if seconds * scale >= 1:
            return scale, unit
    return 1e6, "µs"
