"""The centre of a star: every member's update in one place, a rule applied, one reply.

With ``topology = "star"`` a member's `Reducer.star` sends its compressed update
(error feedback and group-top-k as on the ring) over its `Centre` link
(`engine.star`) to the centre and waits for the reply; the centre here collects
one update per member for the round, combines them, and sends every member the
same result, so the members stay identical.
With client sampling (`sample`) only the round's sample sends; every member still
gets the result, so one that sat out holds the same model.

- ``mean``, ``weighted`` and ``hybrid``: members send ``weight * update`` (their
  manifest weight, 1/N for the mean), the centre sums;
- ``median``, ``trimmed:B`` and ``clip[:TAU]`` (centred clipping): members send
  the update unscaled; the centre takes the coordinate-wise median, the B-trimmed
  mean or the centred-clipped mean, which need all N in one place (a ring never
  has them);
- the sign vote stays on the ring (it is already a majority of 1-bit uplinks).

A robust rule over group-top-k runs on a consensus support (`CentreSettings.
consensus`, set by `build` for median, trimmed and clip with group-top-k; the
members' `ReducerSettings.consensus` likewise): with each member's own top-k the
supports barely overlap and a coordinate-wise median of them is mostly zeros (the
median ended 10 pp below the mean at 1%). Each round, per sampled member:

1. ``vote`` up: the top-k indices of its error-compensated update (`GroupIndices`,
   one byte an index);
2. ``support`` down: the k most voted entries of every group, the same for all
   (ties drawn from the job's seed and the round: a count, so an attacker's
   magnitudes cannot choose them);
3. ``up``: its values on the support, in the support's order (no indices: two
   bytes a value in fp16); error feedback subtracts exactly those, the rest stays
   in its residual;
4. ``down`` to every member: the rule over the stacked ``[N, n*k]`` values,
   scattered on the support.

Bytes up are those of group-top-k (one index and one value an entry) plus a frame;
the price is a second round trip per round. The centre keeps nothing between
rounds, so a coordinator that resumes at round r picks the support the members'
residuals vote for, as an uninterrupted run would (same hashes).

Measured: digits MLP, star, 300 rounds, final accuracy,
``simulate(JobSpec(agents=N, dataset="digits", topology="star", rounds=300,
density=0.01, aggregation=A, seed=S))`` (``compression="none"`` for dense);
attacked runs add ``attack=Attack.parse(K), attackers=F`` (`engine.attack`, the
last F ranks). Uplink bytes per agent: 351 kB for the mean's own top-k, 368 kB
on the consensus support (the vote frame), 20.7 MB dense. Before the support the
median ended at 0.877 and trimmed:0.25 at 0.847 at 1% (seed 0, mean 0.975).

Mean / median / trimmed:0.25 / clip:

- 4 agents, no attack, mean of seeds 0-2: 1% 0.973 / 0.964 / 0.964 / 0.971;
  dense 0.969 / 0.966 / 0.966 / 0.973.

Under attack, seed 0, 1%; attack-free mean 0.975 (4 agents), 0.978 (10 agents):

- 1 of 4: sign-flip 0.883 / 0.978 / 0.978 / 0.958; scale:-10 0.111 / 0.972 /
  0.972 / 0.972; noise 0.964 / 0.975 / 0.975 / 0.975; label-flip 0.928 / 0.969 /
  0.969 / 0.967.
- 10 agents: none 0.978 / 0.967 / 0.961 / 0.981; 2 of 10 sign-flip 0.914 /
  0.936 / 0.955 / 0.958; scale:-10 0.109 / 0.953 / 0.950 / 0.961; noise 0.816 /
  0.967 / 0.969 / 0.975; label-flip 0.908 / 0.969 / 0.975 / 0.983.

- 2 of 10, mean of seeds 0-2 (attack-free mean 0.973): sign-flip - / 0.941 /
  0.942 / 0.954; scale:-10 - / 0.939 / 0.946 / 0.955.

On seed 0 every robust rule ends within 2 pp of the attack-free mean with 1 of 4
attacking; over seeds 0-2 (`fedring bench quality --attacks`, docs/concepts/quality.md)
median and trimmed end 2.1 pp below under scale:-10 and clip 2.7 pp below under a
sign flip. With 2 of 10, clip does under every attack (by a hair under sign-flip
and scale:-10 over 3 seeds: 1.9 and 1.8 pp), while median and trimmed end 2.7 to
3.4 pp below under sign-flip and scale:-10 (a coordinate-wise rule
sees one coordinate at a time, where a flipped update hides in the honest
updates' noise; clip drops the updates pointing away from the median over the
whole vector, `aggregation.rules.aligned`). One seed moves a final accuracy by
about 1 pp (359 test images).

The reply is the result in `down_dtype` (fp16 by default), sent as its exact
sparse form (`GroupSparse`: a count a group, a byte an index, the values) where
that is smaller than dense, as it is for the sum of sparse updates; a member
decodes the same bits either way (`_down`), so hashes do not depend on it.
`fedring simulate` runs the centre on a thread over the in-process transport; the
MQTT coordinator runs it over the broker (`STAR` is then the coordinator's id).

    settings = CentreSettings(aggregation="median", rounds=100)
    served = serve(channel, members=("agent-0", "agent-1", "agent-2"), numel=d,
                   settings=settings)

`serve_async` is the asynchronous centre (SEEDS B): it holds the model, takes
each member's compressed delta as it comes, weights it by ``1 / (1 + staleness)
** power`` (staleness: versions applied since that member last pulled), applies
once `wait` deltas are in (soft synchronisation), and answers every delta with
the current model at once, so a slow member never holds up the others and a lost
one is only dropped. The answer is a patch against the model that member last
received where that is smaller (`engine.async_reply`: the entries changed since,
exact, with the model's sha256), else the model whole. When the last version is
applied each member's next delta is answered with ``phase="end"`` and the final
model, whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from fedring.aggregation.rules import Aggregation, robust
from fedring.collective.channel import (
    CollectiveError,
    CollectiveInterrupted,
    PeerChannel,
    PeerLost,
)
from fedring.compression.payload import Payload, PayloadLimits
from fedring.compression.quantize import DenseChunk, DenseCodec
from fedring.compression.sparse import GroupSparse, n_groups
from fedring.compression.support import GroupIndices, choose_support, scatter
from fedring.engine.async_reply import AsyncBase, AsyncReplies
from fedring.engine.local import LocalWork
from fedring.engine.participation import sampled
from fedring.engine.star import STAR, Centre
from fedring.transport.base import Deadline

log = logging.getLogger(__name__)

__all__ = [
    "STAR", "AsyncSettings", "AsyncState", "Centre", "CentreSettings", "combine",
    "run_async_member", "serve", "serve_async",
]  # fmt: skip


@dataclass(frozen=True)
class CentreSettings:
    aggregation: str = "mean"  # mean | weighted | hybrid:L | median | trimmed:B | clip[:TAU]
    rounds: int = 1  # serve rounds [start_round, rounds)
    start_round: int = 0
    timeout_s: float = 60.0  # wait for one round's updates
    down_dtype: Literal["fp32", "fp16", "bf16"] = "fp16"
    sample: float = 1.0  # client sampling: members per round (`participation.sampled`)
    seed: int = 0  # with the round, picks the sample
    consensus: bool = False  # members send values on a consensus support (robust rules)
    group_size: int = 256  # G of the consensus support (the members' group-top-k)


def combine(updates: torch.Tensor, rule: Aggregation) -> torch.Tensor:
    """One round's result from the stacked updates ``[N, D]`` (see the module docstring)."""
    if rule.robust:
        return robust(updates, rule)
    if rule.kind == "vote":
        raise ValueError("the sign vote runs on the ring, not through a star's centre")
    return updates.sum(dim=0)  # members sent their weighted share


def serve(
    channel: PeerChannel, members: tuple[str, ...], numel: int, settings: CentreSettings
) -> int:
    """Serve rounds until `settings.rounds`; return the rounds served.

    A member that leaves (`PeerLost`), or the owner's interruption, ends the
    service: before any round is served that is an error (raised), afterwards it
    is how a job that reached its target early ends (the members report it to
    their runner). A member that stays but goes silent is a `CollectiveTimeout`,
    raised whenever it happens: returning would leave the members that did send
    waiting out their own timeout for a reply that never comes, and hide why.
    """
    if settings.consensus:
        return _serve_on_support(channel, members, numel, settings)
    rule = Aggregation.parse(settings.aggregation)
    limits = PayloadLimits(max_numel=numel)
    codec = DenseCodec(settings.down_dtype)
    served = 0
    for r in range(settings.start_round, settings.rounds):
        deadline = Deadline.after(settings.timeout_s)
        chosen = sampled(settings.seed, r, len(members), settings.sample)
        try:
            ups = [
                channel.recv(members[i], round=r, step=0, phase="up", deadline=deadline,
                             limits=limits)
                for i in chosen
            ]  # fmt: skip
        except (PeerLost, CollectiveInterrupted):
            if served == 0:
                raise
            return served
        down = _down(codec, combine(torch.stack([u.decompress() for u in ups]), rule),
                     settings.group_size)  # fmt: skip
        for m in members:
            channel.send(m, down, round=r, step=0, phase="down", deadline=deadline)
        served += 1
    return served


def _down(codec: DenseCodec, result: torch.Tensor, group_size: int) -> Payload:
    """The reply: `result` in the codec's dtype, dense, or the exact sparse form of the
    same values where that is smaller. Both decode to the same bits: each adds its
    values to zeros (a -0.0 decodes +0.0 from either)."""
    dense = codec.compress(result)
    values = dense.decompress()
    sparse = GroupSparse.from_dense(values, group_size, (0, n_groups(values.numel(), group_size)))
    return sparse if sparse.wire_nbytes < dense.wire_nbytes else dense


def _serve_on_support(
    channel: PeerChannel, members: tuple[str, ...], numel: int, settings: CentreSettings
) -> int:
    """`serve` with a consensus support (see the module docstring): every round the
    sample's votes, the support they choose back to the sample, its values on it,
    the rule on the stacked values, the dense result to all members."""
    rule = Aggregation.parse(settings.aggregation)
    g = settings.group_size
    codec = DenseCodec(settings.down_dtype)
    limits = PayloadLimits(max_numel=numel)
    served = 0
    for r in range(settings.start_round, settings.rounds):
        deadline = Deadline.after(settings.timeout_s)
        sample = [members[i] for i in sampled(settings.seed, r, len(members), settings.sample)]
        try:
            votes = [_votes(channel, m, r, numel, g, deadline, limits) for m in sample]
            support = choose_support(_tally(votes, numel, r), group_size=g, k=votes[0].k,
                                     seed=settings.seed * 1_000_003 + r)  # fmt: skip
            for m in sample:
                channel.send(m, support, round=r, step=0, phase="support", deadline=deadline)
            values = [_values(channel, m, r, support, deadline) for m in sample]
        except (PeerLost, CollectiveInterrupted):
            if served == 0:
                raise
            return served
        down = _down(codec, scatter(combine(torch.stack(values), rule), support), g)
        for m in members:
            channel.send(m, down, round=r, step=0, phase="down", deadline=deadline)
        served += 1
    return served


def _tally(votes: list[GroupIndices], numel: int, r: int) -> torch.Tensor:
    """Votes per entry; every member must have voted for as many entries a group."""
    ks = sorted({v.k for v in votes})
    if len(ks) != 1:
        raise CollectiveError(f"round {r}: the members voted for {ks} entries a group")
    tally = torch.zeros(numel)
    for v in votes:
        v.add_to(tally)
    return tally


def _votes(
    channel: PeerChannel, member: str, r: int, numel: int, g: int, deadline: Deadline,
    limits: PayloadLimits,
) -> GroupIndices:  # fmt: skip
    got = channel.recv(member, round=r, step=0, phase="vote", deadline=deadline, limits=limits)
    if not isinstance(got, GroupIndices) or got.numel != numel or got.group_size != g:
        raise CollectiveError(f"round {r}: {member!r} sent no votes for groups of {g} "
                              f"over {numel} entries")  # fmt: skip
    return got


def _values(
    channel: PeerChannel, member: str, r: int, support: GroupIndices, deadline: Deadline
) -> torch.Tensor:
    """`member`'s values on `support` for round `r` ([n*k] float32)."""
    got = channel.recv(member, round=r, step=0, phase="up", deadline=deadline,
                       limits=PayloadLimits(max_numel=support.size))  # fmt: skip
    if not isinstance(got, DenseChunk) or got.numel != support.size or got.start != 0:
        raise CollectiveError(f"round {r}: {member!r} sent no values on the round's support "
                              f"({support.size} entries)")  # fmt: skip
    return got.values.to(torch.float32)


@dataclass(frozen=True)
class AsyncSettings:
    rounds: int = 1  # model versions to reach
    start_version: int = 0
    wait: int = 1  # soft synchronisation: apply after this many deltas (1: plain async)
    staleness_power: float = 0.5  # a delta's weight: 1 / (1 + staleness) ** power
    aggregation: str = "mean"  # mean | median | trimmed:B | clip over one application's deltas
    timeout_s: float = 60.0  # no delta from any member for this long ends the service
    patch_replies: bool = True  # a patch against the member's last model where smaller


@dataclass
class AsyncState:
    """The asynchronous centre's model and what it saw; `stop` ends it early (target)."""

    model: torch.Tensor  # flat float32 parameters
    version: int = 0
    staleness: dict[int, int] = field(default_factory=dict)  # staleness -> deltas applied
    lost: list[str] = field(default_factory=list)
    stop: bool = False


def serve_async(
    channel: PeerChannel, members: tuple[str, ...], state: AsyncState, settings: AsyncSettings,
    on_version: Callable[[AsyncState, str], None] | None = None,
) -> AsyncState:  # fmt: skip
    """Apply deltas until `settings.rounds` versions (or `state.stop`); end every member.

    `on_version(state, member)` runs after each application (checkpoint, metrics,
    evaluation; it may set `state.stop`). Raises `CollectiveError` when every
    member is lost or none sent anything for `timeout_s`.
    """
    rule = Aggregation.parse(settings.aggregation)
    alive = set(members)
    pulled = dict.fromkeys(members, state.version)
    limits = PayloadLimits(max_numel=state.model.numel())
    buffer: list[torch.Tensor] = []
    ended: set[str] = set()
    replies = AsyncReplies(state.model, state.version, patches=settings.patch_replies,
                           counters=channel.counters)  # fmt: skip

    def lost(member: str) -> None:
        alive.discard(member)
        state.lost.append(member)

    while alive - ended:
        (src, rnd, _step, phase), delta = channel.recv_any(
            alive - ended, phases=("up", "again"), deadline=Deadline.after(settings.timeout_s),
            limits=limits, on_lost=lost,
        )  # fmt: skip
        if delta.numel != state.model.numel():  # a member's malformed update ends it, not us
            channel.counters.add("async_wrong_size")
            log.warning("async centre: %r sent %d entries for a model of %d: taken for lost",
                        src, delta.numel, state.model.numel())  # fmt: skip
            lost(src)
            if not alive:
                raise CollectiveError("async centre: every member was lost")
            continue
        again = phase == "again"  # the member could not apply its patch: the model whole
        done = state.stop or state.version >= settings.rounds
        if not done and not again:
            staleness = state.version - pulled[src]
            state.staleness[staleness] = state.staleness.get(staleness, 0) + 1
            buffer.append(delta.decompress() / (1.0 + staleness) ** settings.staleness_power)
            if len(buffer) >= settings.wait:
                stacked = torch.stack(buffer)
                update = combine(stacked, rule) if rule.robust else stacked.mean(dim=0)
                old, state.model = state.model, state.model + update
                state.version += 1
                replies.applied(old, state.model, state.version)
                buffer.clear()
                if on_version is not None:
                    on_version(state, src)
            done = state.stop or state.version >= settings.rounds
        # the last reply is whole: a member that ends holds exactly the final model
        reply = replies.reply(src, state.model, state.version, dense=done or again)
        channel.send(src, reply, round=rnd, step=0, phase="end" if done else "down",
                     deadline=Deadline.after(settings.timeout_s))  # fmt: skip
        pulled[src] = state.version
        if done:
            ended.add(src)
    if not ended:
        raise CollectiveError("every member of the asynchronous job was lost")
    return state


def run_async_member(
    work: LocalWork, centre: Centre, compress: Callable[[torch.Tensor], Payload], *,
    steps: int, lr: float, timeout_s: float, pace: float = 1.0,
    before: Callable[[int], None] | None = None,
    on_cycle: Callable[[int, dict[str, float]], None] | None = None,
) -> int:  # fmt: skip
    """An asynchronous member: `steps` local steps, push the compressed delta, take the
    model the centre answers with; until it answers ``end``. Returns the cycles run.

    `pace` > 1 makes the member that many times slower (it sleeps in proportion to
    its compute): how a slow board is emulated on one machine.
    """
    limits = PayloadLimits(max_numel=work.params.numel())
    base = AsyncBase(centre.channel.counters)
    cycle = 0
    while True:
        if before is not None:
            before(cycle)
        anchor = work.params
        start = time.perf_counter()
        losses = work.steps(steps, lr)
        if pace > 1.0:
            time.sleep((pace - 1.0) * (time.perf_counter() - start))
        deadline = Deadline.after(timeout_s)
        centre.channel.send(centre.name, compress(work.params - anchor), round=cycle, step=0,
                            phase="up", deadline=deadline)  # fmt: skip
        phase, params = _pull(centre, base, cycle, deadline, limits)
        work.set_params(params)
        cycle += 1
        if on_cycle is not None:
            on_cycle(cycle, {"loss": sum(losses) / max(len(losses), 1)})
        if phase == "end":
            return cycle


def _pull(
    centre: Centre, base: AsyncBase, cycle: int, deadline: Deadline, limits: PayloadLimits
) -> tuple[str, torch.Tensor]:
    """The centre's reply to this cycle's delta: its phase and the model to train on.
    A patch that cannot be applied here is answered by asking again: the centre then
    sends the model whole (`async_reply`)."""
    for ask in range(2):
        if ask:
            centre.channel.send(centre.name, DenseChunk(limits.max_numel, 0, torch.empty(0)),
                                round=cycle, step=0, phase="again", deadline=deadline)  # fmt: skip
        (_src, _rnd, _step, phase), reply = centre.channel.recv_any(
            (centre.name,), phases=("down", "end"), deadline=deadline, limits=limits
        )
        params = base.take(reply)
        if params is not None:
            return phase, params
    raise CollectiveError(f"{centre.channel.name!r}: the centre's whole model was refused")
