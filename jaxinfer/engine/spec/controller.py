"""The speculation controller: how many drafts each request gets this step (0 .. R).

Speculation pays only when the tokens it adds are worth more than the time it adds, and both
change from step to step: acceptance differs per request and with temperature, and a step
that carries drafts may need a bigger token bucket (a more expensive compiled program) or a
drafter pass. So before the proposer runs, the engine asks `SpecController.plan` for a draft
count per decoding request, and the controller maximises expected output tokens per second:

* Acceptance. Each request keeps an exponentially decayed count of its accepted drafts and
  its trials (accepted drafts plus rejections: a verification that accepted `m` of `k`
  drafts is `m` successes and, if `m < k`, one failure), so its rate `a` is the censored
  geometric estimate. A new request starts from the engine's running prior (the same count
  over every verification, decaying slower). With `k` drafts a verification emits
  `E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)` tokens in expectation, so the j-th
  draft of a request is worth `a^j` tokens.
* Cost. `StepCosts` holds a decayed mean of the target step's measured wall seconds per
  (token bucket, whether it verifies drafts), one table for all-greedy steps and one for
  steps that sample (the sampler's sorts then run on every verified position). Both start
  from timing every bucket once at warm-up (`ModelRunner.time_steps`, on padding), which
  the first real step of each key replaces; a bucket never measured is priced
  pessimistically, growing linearly in tokens from the nearest smaller measured bucket.
  Tokens past the token budget displace prefill tokens to a later step and are priced
  linearly too. The proposer's seconds per call are measured per (sequence bucket of
  drafting requests, whether any request gets more than one draft), started from its own
  warm-up timing where it has one (`time_drafts`), each call moving the estimate by at most
  a factor `MAX_DRAFT_JUMP` (a drafter's first call also prefills the prompt); the engine's
  per-step host overhead (scheduling, outputs) is added to every choice.
* Choice. Every draft is a (request, j) with value `a^j`; taking the D most valuable drafts
  is the best way to spend D draft tokens (values fall with j, so each request gets a prefix).
  The controller evaluates every D from 0 (plain decoding) to what the budget leaves after
  the running requests' own tokens, and takes the D with the most expected tokens per second
  (D = 0 unless speculation is strictly better).
* Probes. A request with no verification for `PROBE_AFTER_STEPS` steps (turned off for low
  acceptance, or because drafts did not pay) may get one draft anyway, longest-waiting
  first, while the extra seconds that costs stay within a probe allowance that grows by
  `probe_fraction` of every step's measured time; a proposer call that then takes longer
  than estimated (a drafter catching up on a probed request's tokens) is charged to the
  allowance too. So probing costs about that share of the run, and a request whose text
  turned copyable comes back.

The cost model can be wrong in practice (a drafter's catch-up after a stretch without
drafts, the sampler's cost, a shared machine), so the controller only decides *which*
requests draft and how much. Whether a step speculates at all is the throughput gate's
choice (`jaxinfer.engine.spec.gate`): per regime (batch bucket, sampling) it measures whole
steps' output tokens per second with the controller's grants and with no drafts, and keeps
speculation on only where it measured more than 3% faster than plain decoding.

Pure Python, no jax: it sees request ids, counts and seconds only.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Mapping, Sequence

# Weight of the past in a request's acceptance counts, per verification.
ACCEPTANCE_DECAY = 0.8
# Weight of the past in the engine's prior, per verification (remembers ~50 verifications).
PRIOR_DECAY = 0.98
# Pseudo-trials a new request's estimate starts with, all at the prior rate.
PRIOR_TRIALS = 2.0
# The prior before any verification.
INITIAL_ACCEPTANCE = 0.5
# Weight of the past in the measured costs, per measurement.
COST_DECAY = 0.8
# A verifying step's cost relative to a plain one of the same bucket, before either is
# measured in a bucket that has both.
VERIFY_OVERHEAD_GUESS = 1.25
# One proposer call moves its cost estimate to at most this many times the estimate.
MAX_DRAFT_JUMP = 2.0
# Steps without a verification after which a request may be probed.
PROBE_AFTER_STEPS = 16
# The probe allowance never exceeds this many mean steps' seconds (no bursts of probes).
MAX_PROBE_STEPS = 2.0


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """E(k): tokens a verification of k drafts emits on average, when each draft is accepted
    with probability `acceptance` given that the ones before it were (the bonus or
    correction token included): `1 + a + ... + a^k`."""
    return sum(acceptance ** j for j in range(num_drafts + 1))


def _bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `size`, or None past the largest."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


class _Rate:
    """A decayed count of successes over trials."""

    __slots__ = ("successes", "trials")

    def __init__(self, rate: float, trials: float) -> None:
        self.successes = rate * trials
        self.trials = trials

    def add(self, successes: float, trials: float, decay: float) -> None:
        self.successes = decay * self.successes + successes
        self.trials = decay * self.trials + trials

    @property
    def rate(self) -> float:
        return self.successes / self.trials if self.trials > 0 else INITIAL_ACCEPTANCE


class StepCosts:
    """Decayed mean wall seconds of the target step per (token bucket, verifies drafts).

    Args:
        token_buckets: The runner's token buckets, ascending; the last is the token budget.
    """

    def __init__(self, token_buckets: Sequence[int]) -> None:
        self.token_buckets = tuple(token_buckets)
        self.seconds_by_key: dict[tuple[int, bool], float] = {}
        self._measured: set[tuple[int, bool]] = set()  # keys seen in real steps
        self._overhead = VERIFY_OVERHEAD_GUESS  # verifying / plain seconds in one bucket

    def observe(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        """Records one step that fed `num_tokens` tokens (its bucket is what it cost); the
        first real step of a key replaces its warm-up timing (padding has no context)."""
        bucket = _bucket_for(num_tokens, self.token_buckets)
        if bucket is None:
            return
        key = (bucket, verifies)
        old = self.seconds_by_key.get(key)
        self.seconds_by_key[key] = seconds if old is None or key not in self._measured else (
            COST_DECAY * old + (1 - COST_DECAY) * seconds)
        self._measured.add(key)
        self._update_overhead()

    def bootstrap(self, seconds_by_key: Mapping[tuple[int, bool], float]) -> None:
        """Takes warm-up timings for keys not measured yet."""
        for key, seconds in seconds_by_key.items():
            self.seconds_by_key.setdefault(key, seconds)
        self._update_overhead()

    @property
    def measured(self) -> bool:
        """Whether any step cost is known."""
        return bool(self.seconds_by_key)

    def seconds(self, num_tokens: int, verifies: bool) -> float | None:
        """Expected seconds of a step feeding `num_tokens` tokens (linear past the largest
        bucket); None before any measurement."""
        largest = self.token_buckets[-1]
        if num_tokens > largest:
            full = self.seconds(largest, verifies)
            return None if full is None else full * num_tokens / largest
        bucket = _bucket_for(max(num_tokens, 1), self.token_buckets)
        plain = self._plain(bucket)
        if not verifies:
            return plain
        known = self.seconds_by_key.get((bucket, True))
        if known is not None:
            return known
        return None if plain is None else plain * self._overhead

    def _plain(self, bucket: int) -> float | None:
        """A plain step's seconds in `bucket`: measured, or priced from the nearest measured
        bucket (linearly in tokens from a smaller one, as much as a larger one)."""
        known = self.seconds_by_key.get((bucket, False))
        if known is not None:
            return known
        plain = {other: seconds for (other, verifies), seconds in self.seconds_by_key.items()
                 if not verifies}
        for (other, verifies), seconds in self.seconds_by_key.items():
            if verifies and other not in plain:
                plain[other] = seconds / self._overhead
        if not plain:
            return None
        smaller = [other for other in plain if other < bucket]
        if smaller:
            nearest = max(smaller)
            return plain[nearest] * bucket / nearest
        return plain[min(plain)]

    def _update_overhead(self) -> None:
        """Measured verifying / plain seconds, averaged over buckets that have both."""
        ratios = [self.seconds_by_key[(bucket, True)] / self.seconds_by_key[(bucket, False)]
                  for bucket in self.token_buckets
                  if (bucket, True) in self.seconds_by_key
                  and self.seconds_by_key.get((bucket, False), 0.0) > 0]
        self._overhead = (max(1.0, sum(ratios) / len(ratios)) if ratios
                          else VERIFY_OVERHEAD_GUESS)


class DraftCosts:
    """Decayed mean wall seconds of one proposer call per (sequence bucket of the drafting
    requests, whether any gets more than one draft).

    Args:
        sequence_buckets: The runner's sequence buckets, ascending.
    """

    def __init__(self, sequence_buckets: Sequence[int]) -> None:
        self.sequence_buckets = tuple(sequence_buckets)
        self.seconds_by_key: dict[tuple[int, bool], float] = {}

    def _key(self, num_requests: int, max_drafts: int) -> tuple[int, bool]:
        bucket = _bucket_for(num_requests, self.sequence_buckets) or self.sequence_buckets[-1]
        return bucket, max_drafts > 1

    def observe(self, num_requests: int, max_drafts: int, seconds: float) -> None:
        """Records one proposer call for `num_requests` requests, the most drafts `max_drafts`.

        A call can be long for a reason that does not recur (a drafter catching up on a
        whole prompt), so one observation counts for at most `MAX_DRAFT_JUMP` times the
        estimate it updates."""
        key = self._key(num_requests, max_drafts)
        old = self.seconds_by_key.get(key)
        self.seconds_by_key[key] = seconds if old is None else (
            COST_DECAY * old + (1 - COST_DECAY) * min(seconds, MAX_DRAFT_JUMP * old))

    def bootstrap(self, seconds_by_key: Mapping[tuple[int, bool], float]) -> None:
        """Takes warm-up timings (per (sequence bucket, loops)) for keys not measured yet."""
        for key, seconds in seconds_by_key.items():
            self.seconds_by_key.setdefault(key, seconds)

    def seconds(self, num_requests: int, max_drafts: int) -> float:
        """Expected seconds of a proposer call: measured, else the nearest measured key's
        (same loop first), else 0 (an unmeasured proposer is tried, then known)."""
        if num_requests == 0:
            return 0.0
        bucket, loops = self._key(num_requests, max_drafts)
        known = self.seconds_by_key.get((bucket, loops))
        if known is not None:
            return known
        candidates = sorted(self.seconds_by_key.items(),
                            key=lambda item: (item[0][1] != loops, abs(item[0][0] - bucket)))
        return candidates[0][1] if candidates else 0.0


@dataclasses.dataclass
class PlanStats:
    """What the controller chose, over all steps.

    Attributes:
        num_request_steps: (request, step) pairs it planned for.
        num_planned_drafts: Drafts it granted over those pairs (probes included).
        num_probes: Drafts granted as probes.
    """

    num_request_steps: int = 0
    num_planned_drafts: int = 0
    num_probes: int = 0

    @property
    def mean_drafts(self) -> float:
        """Mean drafts granted per planned (request, step) (0 before any)."""
        return (self.num_planned_drafts / self.num_request_steps
                if self.num_request_steps else 0.0)


class SpecController:
    """Chooses each step's draft counts from measured acceptance and measured costs.

    Args:
        num_tokens: R, the most drafts per request and step.
        token_buckets: The target runner's token buckets (the last is the token budget).
        sequence_buckets: The runner's sequence buckets (keys of the drafter's cost).
        probe_fraction: The share of measured step time probes may spend.

    Attributes:
        step_costs: The target step's measured costs, for steps with only greedy requests
            (False) and with sampled ones (True: the sampler's sorts, on every verified
            position too).
        draft_costs: The proposer's measured costs.
        stats: What it chose so far.
    """

    def __init__(self, num_tokens: int, token_buckets: Sequence[int],
                 sequence_buckets: Sequence[int], probe_fraction: float = 0.02) -> None:
        self.num_tokens = num_tokens
        self.max_num_batched_tokens = token_buckets[-1]
        self.step_costs = {sampled: StepCosts(token_buckets) for sampled in (False, True)}
        self.draft_costs = DraftCosts(sequence_buckets)
        self.probe_fraction = probe_fraction
        self.overhead_seconds = 0.0  # decayed mean host seconds per step outside the runner
        self.prior = _Rate(INITIAL_ACCEPTANCE, PRIOR_TRIALS)
        self._acceptance: dict[str, _Rate] = {}
        self._last_drafted: dict[str, int] = {}  # request id -> step it last got drafts
        self._step = 0
        self._probe_allowance = 0.0
        self._probed_draft_seconds: float | None = None  # estimate of the probing call
        self._mean_step_seconds = 0.0
        self.stats = PlanStats()

    # ------------------------------------------------------------------ estimates

    def acceptance(self, request_id: str) -> float:
        """The request's estimated acceptance rate (the prior for a request never verified)."""
        rate = self._acceptance.get(request_id)
        return (rate if rate is not None else self.prior).rate

    def bootstrap(self, seconds_by_key: Mapping[tuple[int, bool], float]) -> None:
        """Starts both step cost models from warm-up timings (per (bucket, verifies))."""
        for costs in self.step_costs.values():
            costs.bootstrap(seconds_by_key)

    def step_seconds(self, num_tokens: int, num_drafts: int, num_drafting: int,
                     max_drafts: int, sampled: bool = False) -> float | None:
        """Expected seconds of a whole step: the target step feeding `num_tokens` tokens (of
        which `num_drafts` drafts; `sampled`: some request samples), the proposer for
        `num_drafting` requests, host overhead."""
        target = self.step_costs[sampled].seconds(num_tokens, num_drafts > 0)
        if target is None:
            return None
        return (target + self.draft_costs.seconds(num_drafting, max_drafts)
                + self.overhead_seconds)

    # ------------------------------------------------------------------ choice

    def plan(self, room: Mapping[str, int], *, num_tokens: int, num_emitting: int,
             max_drafts: int, sampled: bool = False) -> dict[str, int]:
        """Draft counts for the coming step.

        Args:
            room: Per decoding, speculating request id (in scheduling order), the most drafts
                it may take (R, or fewer near its length limits).
            num_tokens: Tokens the step would feed without drafts (the running requests' own
                tokens and the prompt tokens of requests waiting to be admitted; more than the
                token budget is fine).
            num_emitting: Requests that emit a token this step without speculation.
            max_drafts: The most drafts the step can take without starving a running request
                (the token budget less the running requests' own tokens).
            sampled: Whether any running request samples (temperature > 0).

        Returns:
            Per request id, its draft count (requests with none are left out).
        """
        self._step += 1
        for request_id in room:
            self._last_drafted.setdefault(request_id, self._step)
        base = min(num_tokens, self.max_num_batched_tokens)
        values = sorted(
            ((self.acceptance(request_id) ** j, -order, request_id)
             for order, (request_id, count) in enumerate(room.items())
             for j in range(1, min(count, self.num_tokens) + 1)),
            reverse=True)[:max(max_drafts, 0)]  # [(value, -order, id)], most valuable first
        counts: collections.Counter[str] = collections.Counter()  # request id -> drafts
        plain = self.step_seconds(base, 0, 0, 0, sampled)
        if plain is not None and num_emitting > 0:
            best_rate, best_drafts = num_emitting / plain, 0
            gain, most = 0.0, 0
            for drafts, (value, _, request_id) in enumerate(values, start=1):
                gain += value
                counts[request_id] += 1
                most = max(most, counts[request_id])
                seconds = self.step_seconds(base + drafts, drafts, len(counts), most, sampled)
                rate = (num_emitting + gain) / seconds
                if rate > best_rate:
                    best_rate, best_drafts = rate, drafts
            counts = collections.Counter(request_id for _, _, request_id
                                         in values[:best_drafts])
        probes = self.stats.num_probes
        self._probe(room, counts, base, max_drafts, sampled)
        self._probed_draft_seconds = (
            self.draft_costs.seconds(len(counts), max(counts.values(), default=0))
            if self.stats.num_probes > probes else None)
        self.stats.num_request_steps += len(room)
        self.stats.num_planned_drafts += sum(counts.values())
        for request_id in counts:
            self._last_drafted[request_id] = self._step
        return dict(counts)

    def _probe(self, room: Mapping[str, int], counts: collections.Counter[str], base: int,
               max_drafts: int, sampled: bool) -> None:
        """Adds one draft for stale requests without any, while the allowance covers it."""
        stale = sorted((self._last_drafted[request_id], request_id)
                       for request_id, count in room.items()
                       if count > 0 and not counts[request_id]
                       and self._step - self._last_drafted[request_id] >= PROBE_AFTER_STEPS)
        if not stale:
            return
        drafts = sum(counts.values())
        before = self.step_seconds(base + drafts, drafts, len(counts),
                                   max(counts.values(), default=0), sampled)
        if before is None:
            return
        for _, request_id in stale:
            if drafts >= max_drafts:
                return
            counts[request_id] = 1
            after = self.step_seconds(base + drafts + 1, drafts + 1, len(counts),
                                      max(counts.values()), sampled)
            if after - before > self._probe_allowance:
                del counts[request_id]
                return
            self._probe_allowance -= after - before
            before, drafts = after, drafts + 1
            self.stats.num_probes += 1

    # ------------------------------------------------------------------ measurements

    def observe_verification(self, request_id: str, num_drafts: int,
                             num_accepted: int) -> None:
        """Records a verification: `num_accepted` of the request's `num_drafts` drafts."""
        if not num_drafts:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        rate = self._acceptance.get(request_id)
        if rate is None:
            rate = self._acceptance[request_id] = _Rate(self.prior.rate, PRIOR_TRIALS)
        rate.add(num_accepted, trials, ACCEPTANCE_DECAY)
        self.prior.add(num_accepted, trials, PRIOR_DECAY)

    def observe_step(self, num_tokens: int, verifies: bool, seconds: float,
                     overhead_seconds: float, sampled: bool = False) -> None:
        """Records a target step that fed `num_tokens` tokens in `seconds` (the runner's
        wall time) plus `overhead_seconds` of host work around it (`sampled`: some request
        sampled); feeds the probe allowance."""
        self.step_costs[sampled].observe(num_tokens, verifies, seconds)
        self.overhead_seconds = (COST_DECAY * self.overhead_seconds
                                 + (1 - COST_DECAY) * overhead_seconds)
        total = seconds + overhead_seconds
        self._mean_step_seconds = (total if not self._mean_step_seconds else
                                   COST_DECAY * self._mean_step_seconds
                                   + (1 - COST_DECAY) * total)
        self._probe_allowance = min(self._probe_allowance + self.probe_fraction * total,
                                    MAX_PROBE_STEPS * self._mean_step_seconds)

    def observe_drafts(self, num_requests: int, max_drafts: int, seconds: float) -> None:
        """Records a proposer call for `num_requests` requests (the most drafts `max_drafts`)."""
        if self._probed_draft_seconds is not None:
            self._probe_allowance -= max(0.0, seconds - self._probed_draft_seconds)
            self._probed_draft_seconds = None
        if num_requests:
            self.draft_costs.observe(num_requests, max_drafts, seconds)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forgets requests that finished or were aborted."""
        for request_id in request_ids:
            self._acceptance.pop(request_id, None)
            self._last_drafted.pop(request_id, None)
