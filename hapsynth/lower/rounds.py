"""The once-per-step ops of a pipeline plan's stages (the optimizer) in rounds: an op runs
in the round after the last one making a value it reads on another stage, the sums
counting as made in round 0. Both runtimes (`Pipelined`, `FreeRunning`) run them so."""
from __future__ import annotations

from dataclasses import dataclass

from hapsynth.lower.wiring import StageWiring

__all__ = ["Rounds", "post_rounds"]


@dataclass(frozen=True, eq=False)
class Rounds:
    """The stage and round making each sum and once-per-step value; each op's round."""

    where: dict     # value -> (stage, round) making it
    level: dict     # once-per-step op -> its round

    @property
    def last(self) -> int:
        """The round after every op's, where state leaves and outputs are gathered."""
        return max([0] + list(self.level.values())) + 1


def post_rounds(w: StageWiring) -> Rounds:
    """The rounds of `w`'s once-per-step ops (`w.post`), its sums made in round 0."""
    where: dict = {t: (s, 0) for s in range(w.S) for t in w.acc[s]}
    level: dict = {}
    for i in sorted(i for ids in w.post.values() for i in ids):
        s = w.stage[i]
        level[i] = max([0] + [where[x][1] + (where[x][0] != s) for x in w.prog.eqns[i].inputs
                              if isinstance(x, int) and x in where])
        for t in w.prog.eqns[i].outputs:
            where[t] = (s, level[i])
    return Rounds(where, level)
