"""How many tokens to draft for one request, from the acceptance it has shown so far.

Drafts the target rejects are not free: on a CPU each one is a token of the verify forward pass,
on a GPU a batch slot. So each request drafts only the tokens likely enough to be accepted:

- From every verified proposal (d drafts, a accepted) the request's `Acceptance` counts a accepted
  drafts and, when a < d, one rejection; both counts decay by `decay` per proposal, so the estimate
  follows the request's text as it changes (a copied passage, then prose). The per-token acceptance
  estimate is p = (accepted + 1) / (accepted + rejected + 2) (Laplace's rule: 0.5 with no evidence).
- The i-th draft of a proposal is accepted with probability about p**i (all drafts before it must
  be). A request drafts k = the largest k <= num_speculative_tokens with p**k >= `min_acceptance`:
  each draft it sends is worth at least that many expected tokens.
- When even one draft is not worth it (p < `min_acceptance`), the request drafts one token (a
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
        "Draft a token only when the chance that the target accepts it is at least this."))
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

    def num_drafts(self, num_speculative_tokens: int, policy: AdaptivePolicy) -> int:
        """How many tokens to draft this step (at most `num_speculative_tokens`)."""
        if not policy.enabled:
            return num_speculative_tokens
        k = worth_drafting(self.p, policy.min_acceptance, num_speculative_tokens)
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


def worth_drafting(p: float, min_acceptance: float, limit: int) -> int:
    """The largest k <= limit with p**k >= min_acceptance (0 when p < min_acceptance)."""
    if p >= 1.0:
        return limit
    if p < min_acceptance:
        return 0
    # p**k >= m  <=>  k <= log(m) / log(p); the epsilon keeps an exact boundary on the inside.
    return min(limit, math.floor(math.log(min_acceptance) / math.log(p) + 1e-9))
