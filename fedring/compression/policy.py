"""``density = "auto"``: the density, its warm-up and a closing flush, chosen from the job.

Error feedback delays what top-k leaves out; it does not drop it. A coordinate
waits about ``1 / density`` rounds for its turn, so a job that trains each member
for fewer rounds than that never delivers most of its gradient: 40 rounds at 1%
lost 11 to 17 pp on digits where 300 rounds at 1% matched dense. The policy keeps
``rounds_trained x sqrt(local_steps) x density >= DELIVERIES`` (each member's
rounds: the job's rounds x the fraction sampled), within a byte budget:

- ``density = clamp(DELIVERIES / (rounds_trained x sqrt(H)), FLOOR, cap)``, where
  H is the local steps behind an update (1 in sync mode) and `cap` is the
  densest that still sends `saving` x fewer bytes than a dense fp32 upload (kept
  values in fp16 with one-byte indices: 3 bytes an entry against 4);
- the DGC warm-up (`schedule.DGC_STAGES`, 10 rounds a stage) only in jobs of at
  least `LONG` rounds trained, where it costs little; a short job starts at its
  density;
- a closing flush in local mode (``sync = "local"``, the Flower mod's updates), where
  every member trains every round and the budget holds a dense round beside the
  sparse ones (from about 5 rounds at the default 3x): the last round sends every
  entry (k = G), so what error feedback still holds reaches the model. There the
  residual holds parameter deltas, already scaled by the rate they were computed
  at. Not in sync mode: there it holds gradients, and a flush applies today's rate
  to all of them at once (measured 1 to 10 pp worse).

Measured by ``fedring bench quality`` (docs/concepts/quality.md); the figures behind the
constants, digits MLP, 4 agents, one seed:

    sync SGD, 300 rounds:    1% -> 0.9805 (dense 0.9777); final flush 0.9749
    local, H = 1, 40 rounds: 1% 0.379; 7.5% + flush 0.540 (dense 0.549)
    local, H = 12, 40:       1% 0.964; 7.5% + flush 0.967 (dense 0.967)
    sync SGD, 40 rounds:     1% 0.830; 7.5% 0.914; 7.5% + flush 0.811 (dense 0.939)

    >>> plan = choose_density(rounds=40, local=True)
    >>> plan.density, plan.warmup, plan.flush
    (0.075, 0, 1)
    >>> choose_density(rounds=600).density
    0.01
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DELIVERIES = 3.0  # rounds_trained x density: error feedback's turns through the job
FLOOR = 0.01  # never sparser than 1% (3 of 256 a group)
LONG = 300  # rounds trained from which the DGC warm-up pays for itself
WARMUP = 10  # rounds a warm-up stage, as DGC
# Default budget: at least 3x fewer uplink bytes than dense fp32. Accuracy first: a
# job that trains each member 30 rounds or more gets 10x or better anyway (<= 10%);
# a shorter one spends up to 37% a round rather than lose what 10x would cost
# (FedAvg, 10 of 50 sampled, 40 rounds, 1 step: 8 rounds a member; 3 seeds, simulate:
# 37.5% -0.28 pp at 3.5x, 30% -0.65 pp at 4.4x, 22% -1.67 pp at 5.9x, 11% -5.5 pp).
SAVING = 3.0
MARGIN = 1.2  # headroom under the budget for headers and the closing flush
BYTES_KEPT = 3.0  # an fp16 value and a one-byte index
BYTES_DENSE = 4.0  # an fp32 entry


@dataclass(frozen=True)
class DensityPlan:
    """What `choose_density` picked and why (the summary's ``density_auto``)."""

    density: float
    warmup: int  # rounds a DGC warm-up stage; 0 = off
    flush: int  # closing rounds at k = G
    reason: str

    def fields(self) -> dict[str, object]:
        """The plan under the names of the settings it fills, as `JobSpec` and
        `ReducerSettings` both call them."""
        return {"density": self.density, "density_warmup": self.warmup,
                "density_flush": self.flush, "density_auto": self.reason}  # fmt: skip


def cap_for(saving: float) -> float:
    """The densest density that sends `saving` x fewer bytes than dense (with `MARGIN`)."""
    if not saving >= 1.0:
        raise ValueError(f"saving={saving!r} must be a number >= 1")
    return min(1.0, BYTES_DENSE / (BYTES_KEPT * saving * MARGIN))


def choose_density(
    *, rounds: int, local: bool = False, participation: float = 1.0,
    saving: float = SAVING, local_steps: int = 1,
) -> DensityPlan:  # fmt: skip
    """The density plan of a job (module docstring): `rounds` the job's rounds,
    `local` whether members agree on parameter deltas (local mode, FedAvg),
    `participation` the fraction of members trained a round, `local_steps` the
    steps behind each local update (sync mode: 1). An update of H steps needs
    sqrt(H) times fewer turns: with 12 steps, 1% held within 0.3 to 0.9 pp of dense
    where 1 step needed 7.5 to 22% (`fedring bench quality`)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be >= 1")
    if not 0.0 < participation <= 1.0:
        raise ValueError(f"participation={participation!r} must be in (0, 1]")
    trained = rounds * participation
    cap = max(FLOOR, cap_for(saving))
    if type(local_steps) is not int or local_steps < 1:
        raise ValueError(f"local_steps={local_steps!r} must be an integer >= 1")
    steps = local_steps if local else 1
    density = round(min(cap, max(FLOOR, DELIVERIES / (trained * math.sqrt(steps)))), 4)
    warmup = WARMUP if trained >= LONG else 0
    # the flush (a dense round) only where it fits the budget with the sparse rounds
    spent = MARGIN * BYTES_KEPT / BYTES_DENSE * ((trained - 1) * density + 1)
    flush = 1 if local and participation == 1.0 and spent <= trained / saving else 0
    why = [
        f"{trained:g} rounds trained a member"
        + (f" of {steps} local steps" if steps > 1 else "")
        + f": density {density:g} (error feedback needs ~{1 / density:.0f} rounds a turn; "
        f"{DELIVERIES:g} / (rounds x sqrt(steps)), at least {FLOOR:g}, at most {cap:.3g} for "
        f"{saving:g}x fewer bytes than dense)",
        "DGC warm-up 10 rounds a stage" if warmup else f"no warm-up (under {LONG} rounds)",
        "closing flush: the last round sends every entry (local updates)" if flush
        else "no closing flush (sync gradients)" if not local
        else "no closing flush (sampled: the last round reaches a few members only)"
        if participation < 1.0
        else f"no closing flush (a dense round breaks {saving:g}x in {trained:g} rounds)",
    ]  # fmt: skip
    return DensityPlan(density, warmup, flush, "; ".join(why))
