"""How a plan, a cluster and an inspect report look: HTML for notebooks (`html`) and
matplotlib pictures (`plots`, the `[plot]` extra). Nothing here is needed to plan or run."""
