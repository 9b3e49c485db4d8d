"""The fail-slow detectors' names, weights and thresholds (``FailSlowConfig``), drill-sized by default."""

from __future__ import annotations

from dataclasses import dataclass, field

from rankscope.analyzers.rounds import DEFAULT_MAJORITY
from rankscope.analyzers.stack_samples import MIN_GAP, ODDS_MARGIN

DETECTORS: tuple[str, ...] = ("step_time", "metrics", "minder", "stacks", "ccl", "p2p_wait", "samples")

# How much one detector alone is trusted. Step time, stacks and the CCL
# counters watch the training itself; host/GPU metrics only correlate with it.
DEFAULT_WEIGHTS: dict[str, float] = {"step_time": 0.75, "metrics": 0.6, "minder": 0.6, "stacks": 0.8, "ccl": 0.8,
                                     "p2p_wait": 0.6, "samples": 0.9}


@dataclass(frozen=True, slots=True)
class FailSlowConfig:
    """Thresholds, in drill-sized defaults (the papers' production values in comments)."""

    window_s: float = 30.0  # Aegis T (10 min in production)
    continuity_s: float = 20.0  # Minder continuity (4 min in production)
    step_window_s: float = 20.0  # how long a machine's step time must stay above its peers'
    k_sigma: float = 2.0  # Aegis λ + kδ
    rel_floor: float = 0.05  # smallest δ as a fraction of λ
    minder_window_points: int = 8  # Minder w
    similarity_threshold: float = 0.10  # Minder: smallest relative distance that makes a candidate
    separation: float = 1.5  # Minder: candidate's distance over the runner-up's
    step_ratio: float = 1.2  # step time this many times the peers' is "slow"
    alpha: float = 0.8  # Aegis §5.2 TD < α·mean: the late arriver (the plugin keeps N over the last L=5 requests)
    beta: float = 1.5  # Aegis §5.2 N > β·mean: a slow link
    rounds_needed: int = 5  # ByteRobust: rounds of stack aggregation before naming the degrader
    stack_majority: float = DEFAULT_MAJORITY  # the degrader is flagged in more than this share of the rounds (rounds.tally)
    ccl_calls_window: int = 20  # a rank's last collective calls (per communicator) that are tallied
    ccl_min_calls: int = 15  # calls seen before a rank can be blamed
    ccl_fraction: float = 0.8  # share of its calls in which a rank must be flagged
    ccl_min_lateness_s: float = 0.005  # a late arrival counts only if this much later than the mean...
    ccl_min_lateness_share: float = 0.05  # ...and this share of the job's step time, when known
    ccl_waited_share: float = 0.2  # a blamed rank late in this share of its calls on a group another waited in
    p2p_window: int = 30  # polls over which pipeline peers' waits are counted
    p2p_min_polls: int = 20  # polls seen before a rank can be blamed for its peers' waits
    p2p_min_share: float = 0.5  # share of those polls in which some peer waited on it
    p2p_ratio: float = 2.5  # ...and this many times as often as on its data-parallel peers
    p2p_hold_s: float = 10.0  # how long that must last before it alarms (one flickering poll must not)
    samples_horizon_s: float = 45.0  # sampled windows kept for the wait test (the agents' clocks)
    samples_odds_margin: float = ODDS_MARGIN  # the null: a rank's odds of waiting at least this share of its peers'...
    samples_min_gap: float = MIN_GAP  # ...and its waiting share no more than this far below theirs
    samples_min: int = 20  # samples of a rank before it is tested
    samples_alarm_p: float = 0.001  # corrected p-value below which the wait test alarms
    confident_at: float = 0.7
    # On a job whose collectives run on an accelerator every host waits at the same synchronisation call and a
    # pipeline's last stage always stands apart: the host's stacks (rounds and samples) are one vote, held below
    # ``confident_at``, that the device's evidence (the counters' TD and N) or the step time must confirm.
    host_weight_on_device: float = 0.6
    confidence_half_life_s: float = 30.0  # how fast a suspect's confidence fades while weaker evidence still names it
    history_len: int = 600
    max_age_s: float = 900.0  # how much series history to keep
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))


def config_for(window_s: float, continuity_s: float, rounds_needed: int) -> FailSlowConfig:
    """The detectors' config from the three knobs a person sets (``watch`` and ``attach``): Aegis T, Minder's
    continuity and ByteRobust's rounds; a machine's step time must stay slow for the shorter of the first two."""
    return FailSlowConfig(window_s=window_s, continuity_s=continuity_s, step_window_s=min(window_s, continuity_s),
                          rounds_needed=rounds_needed)
