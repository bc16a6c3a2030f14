"""Chain-length policies: how many proposals K each round drafts.

`static` drafts K every round; `adaptive` (`AdaptiveChain`) picks each round's K from the acceptance seen so far
and the measured verify and draft costs. Their names are models.choices.POLICIES, which the loop, the command
lines, the server and the config's validation read. The expected tokens per round of a chain, `predicted_tau`, is
a fact of the draft's per-position acceptance and lives in models.draft, where the draft stage also reads it.
"""

from __future__ import annotations

from models.draft import predicted_tau


class StaticChain:
    """K every round."""

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> int:
        return self.k

    def update(self, k: int, a: int, verify_ms: float, draft_ms: float) -> None:
        pass


class AdaptiveChain:
    """Picks each round's K in [1, max_k] to maximise expected tokens per millisecond,
    predicted_tau(alpha[:K]) / (verify_ms(K+1) + K * draft_step_ms).

    alpha_i (acceptance at position i, given position i was reached) is a count with a prior (`prior`
    with weight `prior_weight`) whose observations fade by `memory` per round: acceptance drifts with the
    text, and a position that a short K stopped reaching drifts back to the prior and is tried again.
    Round timings on a shared CPU are noisy, so the costs are robust: verify_ms(T) is a fading mean per
    window size (a sample is clipped at twice the current mean), made non-decreasing in T (pool adjacent
    violators). A window not tried yet is priced from `window_costs` ({T: ms} measured on the engine before
    the first round, `measure_window_costs`) scaled to the nearest tried window, so a window one row past the
    GEMM's row tile is known to be dear before it is tried; without them it reads as the nearest tried size
    at or below T (so it gets tried). draft_step_ms is a fading mean per draft call."""

    def __init__(self, max_k: int, start_k: int, prior: float = 0.8, prior_weight: float = 2.0,
                 memory: float = 0.97, window_costs: dict[int, float] | None = None):
        self.max_k, self.k, self.memory = max_k, start_k, memory
        self.window_costs = window_costs or {}
        self.prior_acc, self.prior_reach = prior * prior_weight, prior_weight
        self.acc = [self.prior_acc] * max_k
        self.reach = [self.prior_reach] * max_k
        self.verify: dict[int, list[float]] = {}  # T -> [faded sum of ms, faded count]
        self.draft = [0.0, 0.0]  # faded sum of draft ms, faded number of draft calls

    def _mean(self, t: int) -> float:
        total, n = self.verify[t]
        return total / n

    def verify_costs(self) -> dict[int, float]:
        """Per measured T, the fading means made non-decreasing in T (pool adjacent violators)."""
        blocks = []  # [weighted sum, weight, sizes]
        for t in sorted(self.verify):
            blocks.append([self.verify[t][0], self.verify[t][1], [t]])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                last = blocks.pop()
                blocks[-1] = [blocks[-1][0] + last[0], blocks[-1][1] + last[1], blocks[-1][2] + last[2]]
        return {t: total / n for total, n, sizes in blocks for t in sizes}

    def verify_cost(self, t: int, costs: dict[int, float] | None = None) -> float:
        costs = self.verify_costs() if costs is None else costs
        if t in costs:
            return costs[t]
        if t in self.window_costs:  # untried: its measured cost, scaled as the nearest tried window's
            near = min((s for s in costs if s in self.window_costs), key=lambda s: abs(s - t), default=None)
            if near is not None:
                return self.window_costs[t] * costs[near] / self.window_costs[near]
        below = [s for s in costs if s <= t]
        return costs[max(below)] if below else costs[min(costs)]

    def predicted_tau(self, k: int) -> float:
        return predicted_tau([self.acc[i] / self.reach[i] for i in range(k)])

    def choose(self) -> int:
        if not self.verify or self.draft[1] == 0:
            return self.k
        costs, step = self.verify_costs(), self.draft[0] / self.draft[1]
        self.k = max(range(1, self.max_k + 1),
                     key=lambda k: self.predicted_tau(k) / (self.verify_cost(k + 1, costs) + k * step))
        return self.k

    def update(self, k: int, a: int, verify_ms: float, draft_ms: float) -> None:
        if k < 1:
            return
        m = self.memory
        self.acc = [self.prior_acc + m * (x - self.prior_acc) for x in self.acc]
        self.reach = [self.prior_reach + m * (x - self.prior_reach) for x in self.reach]
        for i in range(min(a + 1, k)):  # positions 0..a were reached; 0..a-1 accepted
            self.reach[i] += 1
            self.acc[i] += i < a
        if k + 1 in self.verify:
            verify_ms = min(verify_ms, 2 * self._mean(k + 1))
        for sums in self.verify.values():
            sums[0], sums[1] = m * sums[0], m * sums[1]
        total, n = self.verify.get(k + 1, [0.0, 0.0])
        self.verify[k + 1] = [total + verify_ms, n + 1]
        step = self.draft[0] / self.draft[1] if self.draft[1] else None
        draft_ms = draft_ms if step is None else min(draft_ms, 2 * step * k)
        self.draft = [m * self.draft[0] + draft_ms, m * self.draft[1] + k]
