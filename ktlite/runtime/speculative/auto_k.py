"""How many drafts a request verifies when the user leaves --speculative-num-steps out.

A verify step over a request's last token and k drafts costs c(k) plain decode steps (measured before serving,
runtime/verify.py `verify_cost_curve`: on CPU experts the union of the k + 1 tokens' experts grows with k, so c(k)
grows about linearly); it yields E(a, k) = (1 - a^(k+1)) / (1 - a) tokens when each draft is right with probability
a (the first miss ends the chain). Each step, a request drafts the k in 1..config.MAX_AUTO_SPECULATIVE_DRAFTS with
the most tokens per unit of time, E(a, k) / c(k), at its own acceptance so far (`Acceptance`: the drafts' per-token
hit rate, starting from a prior). A request whose drafts keep missing falls to k = 1; one that copies its prompt
climbs to the most; where no k pays at its acceptance, it drafts nothing but one probe every PROBE_INTERVAL steps.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.6  # what a request is assumed to accept before its first verify
PRIOR_WEIGHT = 2.0  # in draft tokens: a few verifies outweigh it
PROBE_INTERVAL = 16  # a request that drafts nothing still verifies one draft every this many steps (to learn)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step yields (its own token and the accepted drafts) when each of k drafts is right with
    probability `acceptance`."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_drafts(acceptance: float, cost: dict[int, float]) -> int:
    """The k of `cost` (k -> c(k)) with the most expected tokens per plain step's time, the smaller k on a tie; 0
    where no k beats a plain step at this acceptance (E(a, k) <= c(k): a verify's cost grows about as fast as the
    tokens it may give, as for CPU experts, whose union over the verified tokens grows with k)."""
    best = max(sorted(cost), key=lambda k: (expected_tokens(acceptance, k) / cost[k], -k))
    return best if expected_tokens(acceptance, best) > cost[best] else 0


@dataclass
class Acceptance:
    """One request's draft hits and misses: a verify of d drafts that accepted m of them saw m hits and, when
    m < d, one miss (the drafts after it were never judged)."""

    hits: float = 0.0
    misses: float = 0.0
    idle: int = 0  # steps in a row it drafted nothing because no k paid

    def drafts(self, cost: dict[int, float]) -> int:
        """This step's draft count: best_drafts at the estimate, and one draft every PROBE_INTERVAL steps while that
        is 0, so that the estimate still follows the request (its prompt may start to be copied)."""
        k = best_drafts(self.estimate(), cost)
        if k:
            self.idle = 0
            return k
        self.idle += 1
        return 1 if self.idle % PROBE_INTERVAL == 0 else 0

    def record(self, drafted: int, accepted: int) -> None:
        self.hits += accepted
        self.misses += 1 if accepted < drafted else 0

    def estimate(self) -> float:
        return (self.hits + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.hits + self.misses + PRIOR_WEIGHT)
