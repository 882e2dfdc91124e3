"""How many tokens to draft for one request, from the acceptance it has shown so far.

Drafts the target rejects are not free: on a CPU each one is a token of the verify forward pass,
on a GPU a batch slot. So each request drafts only the tokens likely enough to be accepted:

- From every verified proposal (d drafts, a accepted) the request's `Acceptance` counts a accepted
  drafts and, when a < d, one rejection; both counts decay by `decay` per proposal, so the estimate
  follows the request's text as it changes (a copied passage, then prose). The per-token acceptance
  estimate is p = (accepted + 1) / (accepted + rejected + 2) (Laplace's rule: 0.5 with no evidence).
- The i-th draft of a proposal is accepted with probability about p**i (all drafts before it must
  be). A request drafts k = the largest k <= num_speculative_tokens with p**k >= the threshold:
  each draft it sends is worth at least that many expected tokens.
- The threshold comes from the engine's load (`StepCost`, in the proposer): a draft is worth
  sending when its chance of acceptance beats what its verify slot costs, b * R (b: the seconds
  one more verified token adds to a step, R: the tokens per second the engine makes), so it is
  low for one request on a memory-bound step and passes 1 (nothing drafted) when verify tokens
  are paid one by one. Until the proposer has fitted b, `min_acceptance` stands in.
- When even one draft is not worth it (p under the threshold), the request drafts one token (a
  probe), then nothing for `pause_steps` steps; each probe that does not bring drafting back doubles
  the pause, up to `max_pause_steps`. A request that stops drafting thus costs the target nothing
  but a one-token probe now and then, and picks drafting up again when its text turns copyable.
- The pause is handed to the engine's proposer (`take_pause`, `StepReply.quiet`): it leaves the
  request out of the next steps' calls, and when every request of a step is paused it makes no
  call at all, so a paused request costs neither the service nor the engine a round trip.

Proposals the drafter left empty (no n-gram match) teach nothing and change nothing.
SGLang adapts its number of draft steps from the observed acceptance length in the same spirit
(`--speculative-num-steps` chosen from a running mean); this is the per-request version.

Example:
    >>> policy = AdaptivePolicy()
    >>> acceptance = Acceptance()
    >>> acceptance.num_drafts(8, policy)          # no evidence yet: p = 0.5
    1
    >>> for _ in range(3):
    ...     acceptance.observe(drafted=4, accepted=4, policy=policy)
    >>> acceptance.num_drafts(8, policy)          # a copying request drafts the most it may
    8
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import ConfigDict, Field, PositiveInt
from pydantic.dataclasses import dataclass as pydantic_dataclass


# A pydantic dataclass: the app config validates `draft.adaptive` as this class.
@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class AdaptivePolicy:
    """Per-request speculation depth (see the module docstring). `enabled: false` drafts
    `num_speculative_tokens` for every request, every step."""

    enabled: bool = Field(True, description=(
        "false: draft `num_speculative_tokens` for every request, every step."))
    min_acceptance: float = Field(0.3, gt=0, lt=1, description=(
        "Draft a token only when the chance that the target accepts it is at least this, until "
        "the engine's step-cost model (the proposer's `StepCost`) has a threshold from the "
        "engine's load; from then on that threshold."))
    decay: float = Field(0.8, gt=0, le=1, description=(
        "Weight the acceptance counts keep per verified proposal (lower: forget faster)."))
    pause_steps: PositiveInt = Field(8, description=(
        "Steps a request drafts nothing after a one-token probe when not even one draft is worth "
        "it; each probe that does not bring drafting back doubles the pause."))
    max_pause_steps: PositiveInt = Field(256, description="The longest such pause, in steps.")


@dataclass
class Acceptance:
    """One request's acceptance so far and its drafting pause."""

    accepted: float = 0.0
    rejected: float = 0.0
    pause_left: int = 0  # steps to draft nothing before the next probe
    next_pause: int = 0  # the pause after the next probe (0: `pause_steps`)

    @property
    def p(self) -> float:
        """Estimated chance that the target accepts a draft, given it accepted the ones before."""
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)

    def observe(self, drafted: int, accepted: int, policy: AdaptivePolicy) -> None:
        """A proposal of `drafted` tokens was verified and `accepted` of them were kept."""
        if drafted <= 0:
            return
        self.accepted = self.accepted * policy.decay + accepted
        self.rejected = self.rejected * policy.decay + (accepted < drafted)

    def num_drafts(self, num_speculative_tokens: int, policy: AdaptivePolicy,
                   min_acceptance: float | None = None) -> int:
        """How many tokens to draft this step (at most `num_speculative_tokens`): those whose
        chance of acceptance is at least `min_acceptance` (the engine's load makes it; None:
        `policy.min_acceptance`)."""
        if not policy.enabled:
            return num_speculative_tokens
        threshold = policy.min_acceptance if min_acceptance is None else min_acceptance
        k = worth_drafting(self.p, threshold, num_speculative_tokens)
        if k > 0:
            self.pause_left, self.next_pause = 0, 0
            return k
        if self.pause_left > 0:
            self.pause_left -= 1
            return 0
        self.pause_left = self.next_pause or policy.pause_steps
        self.next_pause = min(2 * self.pause_left, policy.max_pause_steps)
        return min(1, num_speculative_tokens)  # the probe


    def take_pause(self) -> int:
        """The steps left in the current pause, handed to the caller (the proposer skips them):
        the next proposal is then the probe."""
        steps, self.pause_left = self.pause_left, 0
        return steps


# The least threshold a step-cost model asks for: under it every draft up to k would be sent
# anyway (and a zero threshold has no logarithm). Past 1 nothing is drafted (no draft is certain).
MIN_ACCEPTANCE_FLOOR = 0.01


@dataclass
class StepCost:
    """The engine's step time against the tokens it verifies, fitted online in the proposer: the
    acceptance a draft needs to be worth its verify cost at the current load.

    A step that verifies N tokens (each request's sampled token plus its drafts) takes about
    T(N) = a + b * N. Drafting one more token, accepted with probability q, adds q expected tokens
    and b seconds; it raises the engine's tokens per second R = tokens / T exactly when
    q > b * R. So `min_acceptance()` = b * R: small while a step costs the same with or without a
    few more tokens (a memory-bound decode, one request), large when verify tokens are paid for one
    by one (a compute-bound batch), and past 1 no draft is worth sending.

    `observe` takes decode steps only (every request of the step was decoding in the previous one
    too, so no prefill hides in N); a, b and R are weighted least squares and means over them,
    each step's weight `decay` times the next's. Until `min_samples` steps, and until N has
    varied enough to tell b from a, there is no estimate (None).

    Example:
        >>> cost = StepCost()
        >>> for n in [1, 2, 3, 4, 5] * 4:            # 20 ms + 2 ms per verified token
        ...     cost.observe(verified=n, produced=2, seconds=0.020 + 0.002 * n)
        >>> round(cost.marginal_s(), 6), round(cost.min_acceptance(), 3)
        (0.002, 0.153)
    """

    decay: float = 0.98
    min_samples: int = 16
    min_spread: float = 0.25  # the weighted variance of N, in tokens squared, needed to fit b
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _t: float = 0.0
    _nt: float = 0.0
    _produced: float = 0.0
    _b: float | None = None
    samples: int = 0

    def observe(self, verified: int, produced: int, seconds: float) -> None:
        """One decode step: `verified` tokens in the forward pass, `produced` tokens kept."""
        d = self.decay
        self._w = self._w * d + 1.0
        self._n = self._n * d + verified
        self._nn = self._nn * d + verified * verified
        self._t = self._t * d + seconds
        self._nt = self._nt * d + verified * seconds
        self._produced = self._produced * d + produced
        self.samples += 1

    def marginal_s(self) -> float | None:
        """b: the seconds one more verified token adds to a step (None: not known yet). While
        N stays too even to fit it (nothing drafted for a while), the last fit stands."""
        spread = self._w * self._nn - self._n * self._n
        if self.samples >= self.min_samples and spread >= self.min_spread * self._w * self._w:
            self._b = max(0.0, (self._w * self._nt - self._n * self._t) / spread)
        return self._b

    def min_acceptance(self) -> float | None:
        """b * R, at least `MIN_ACCEPTANCE_FLOOR` (None: not known yet)."""
        b = self.marginal_s()
        if b is None or self._t <= 0:
            return None
        return max(MIN_ACCEPTANCE_FLOOR, b * self._produced / self._t)


def worth_drafting(p: float, min_acceptance: float, limit: int) -> int:
    """The largest k <= limit with p**k >= min_acceptance (0 when p < min_acceptance; `limit`
    when min_acceptance <= 0, as model runner V2 asks: every slot is verified anyway)."""
    if p >= 1.0 or min_acceptance <= 0.0:
        return limit
    if p < min_acceptance:
        return 0
    # p**k >= m  <=>  k <= log(m) / log(p); the epsilon keeps an exact boundary on the inside.
    return min(limit, math.floor(math.log(min_acceptance) / math.log(p) + 1e-9))
