"""JobSpec: everything that defines a training job, loaded from flags or a TOML file.

One flat table of fields, each with one comment. A TOML job file holds the same
keys at the top level (or under ``[job]``); unknown keys are refused and every
error names the field and the value. `resolved()` is what `--out DIR` writes back.

    >>> spec = JobSpec.from_mapping({"agents": 8, "density": 0.001})
    >>> spec.agents, spec.k
    (8, 1)
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedring.aggregation.rules import Aggregation
from fedring.compression.settings import SettingsError, check_codec

SYNC_MODES = ("sync", "local", "adaptive", "async")
TOPOLOGIES = ("auto", "ring", "torus", "star")
COLLECTIVES = ("ring", "fanout", "hub", "auto")  # auto: `build.choose_collective`
LR_SCALINGS = ("linear", "sqrt", "none")
INITS = ("sent", "derived")
RESYNCS = ("mixed", "always", "never")  # as `engine.resync.RESYNC_POLICIES`
PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # fedring.pipeline.schedule.SCHEDULES
ACTIVATION_DTYPES = ("fp32", "fp16")
PIPELINE_COSTS = ("counted", "measured")
MAX_TIMEOUT_S = 3600.0  # the longest a collective step may wait (`timeout_s`, a manifest's)
AUTO_LR_EF_SGD = 0.1  # lr 0 (auto) under group-top-k sync: plain EF-SGD, no momentum
AUTO_LR = 0.025  # lr 0 (auto) otherwise: momentum SGD
TASK_REF = re.compile(r"[A-Za-z_][\w.-]*(:[A-Za-z_]\w*)?")


class SpecError(ValueError):
    """A job field with a bad value; the message names the field."""


@dataclass(frozen=True)
class JobSpec:
    agents: int = 4  # N agents in the ring
    dataset: str = "digits"  # digits | mnist1d | synthetic[:N:D:C] | npz:PATH
    model: str = "mlp"  # mlp | cnn | MODULE:FACTORY
    # A user's task instead of dataset + model: an entry-point name in the group
    # "fedring.tasks", or MODULE:ATTR (agents load it only if their config allows MODULE).
    task: str = ""
    sharding: str = "iid"  # iid | dirichlet:ALPHA | quantity:BETA
    # none | group-topk | auto (dense fp32 or group-top-k, chosen per epoch with the
    # collective from the members' probes: `fedring.choose`; resolves to group-topk
    # with `compression_auto` set)
    compression: str = "group-topk"
    compression_auto: bool = False  # set by compression "auto": the coordinator picks the codec
    # Kept fraction per group (k = round(density * group_size)), or "auto": chosen with
    # its warm-up and a closing flush from the rounds, the mode and the sample
    # (`compression.policy`; the choice and its reason land in `density_auto`).
    density: float | str = "auto"
    group_size: int = 256  # G; <= 256 gives uint8 indices
    value_dtype: str = "fp16"  # wire dtype of kept values
    error_feedback: bool = True  # off only to measure its effect
    density_warmup: int = 10  # rounds per DGC warm-up stage (25%, 6.25%, 1.56%, 0.4%); 0 = off
    density_flush: int = 0  # the last this many rounds send every entry (k = G); 0 = off
    saving: float = 3.0  # density "auto": at least this many times fewer bytes than dense
    density_auto: str = ""  # set by density "auto": what it chose and why
    policy: str = "bounded"  # sparse ring policy: bounded | exact
    topology: str = "auto"  # auto | ring | torus (2-D ring) | star (a centre: median, trimmed)
    # How a round's sum travels: ring (2(N-1) steps, or the topology's torus) | fanout
    # (each broadcasts once, all sum) | hub (rank 0 sums, broadcasts once) | auto (the
    # smallest predicted from the members' probes, re-planned when the ring re-forms).
    collective: str = "ring"
    sync: str = "sync"  # sync | local | adaptive | async
    local_steps: int = 4  # H: local steps between syncs (local, adaptive, async)
    aggregation: str = "mean"  # mean | weighted | vote | hybrid:L[-L2] | median | trimmed:B | clip
    weight_cap: float = 2.0  # weighted: no agent above cap x its equal share
    async_wait: int = 1  # async soft sync: apply after this many updates (1 = plain async)
    staleness_power: float = 0.5  # async weight 1 / (1 + staleness) ** power
    slow: str = ""  # agent speed factors, e.g. "3:0" makes agent 0 three times slower
    # Agents per round (FedAvg-style client sampling; a star): a fraction in (0, 1] of
    # them, or a whole number >= 2 of them; 1.0 = every agent every round. Seeded by
    # `seed` and the round, so every runner samples the same agents.
    sample: float = 1.0
    # What a sampled agent does with the error-feedback residual it kept while it sat
    # out: keep | reset | decay:G (x G per round missed).
    sit_out: str = "keep"
    # Over MQTT (SEEDS A: "retry automatically or degrade to asynchronous updates"): a
    # ring re-formed `degrade_after` times, each within `degrade_window` rounds or
    # `degrade_window_s` seconds of the one before (a round count alone misses a fast
    # ring whose boards take 10 s to restart), goes on asynchronously through the
    # coordinator, and back to the ring once no agent came or went for `degrade_calm`
    # versions. `degrade_after` 0 = never degrade; `degrade_window_s` 0 = rounds only.
    degrade_after: int = 3
    degrade_window: int = 50
    degrade_window_s: float = 300.0
    degrade_calm: int = 50
    correction: float = 0.1  # adaptive: pull toward the global model during local steps
    rounds: int = 600  # communication rounds
    batch_size: int = 32  # per agent
    # Base learning rate for one node at ref_batch (x N with linear scaling); 0 = auto:
    # 0.1 for group-top-k in sync mode (plain EF-SGD), else 0.025 (momentum SGD).
    lr: float = 0.0
    lr_auto: bool = False  # set where lr was 0: the dense plan of compression "auto" retunes
    ref_batch: int = 32  # batch size that lr was tuned for
    lr_scaling: str = "linear"  # linear | sqrt | none (only when updates are averaged)
    warmup_steps: int = 50  # gradual warm-up to the scaled lr (Goyal et al. 2017)
    momentum: float = 0.9  # SGD momentum (dense rings, local steps, async)
    # Group-top-k sync: run the momentum inside error feedback (DGC momentum
    # correction). Off by default: with 8+ non-iid agents or 0.1% density it lags
    # or collapses, where plain EF-SGD (no momentum, lr 0.1) keeps up with dense.
    momentum_correction: bool = False
    eval_every: int = 10  # rounds between evaluations (and divergence checks)
    target_accuracy: float = 0.0  # stop once reached (0 = run all rounds)
    seed: int = 0  # seeds data split, shards, init and batches
    # How members get the initial model: "sent" (the coordinator's parameters, hash-
    # checked; works across architectures) or "derived" (each rebuilds it from the
    # seed and compares hashes; only where every board's torch draws the same bits).
    init: str = "sent"
    # Boards of different CPU architectures (x86_64, aarch64) round some float ops
    # differently, so their parameters drift apart in the last bits. "mixed": when the
    # fleet mixes architectures, the ring's head sends its parameters to every member
    # every `resync_every` rounds and at the end (hashes compared per architecture
    # between, fleet-wide at a re-sync; the summary reports the drift); "always" does
    # that in any fleet; "never" never (docs/fleet.md).
    resync: str = "mixed"
    resync_every: int = 50
    timeout_s: float = 60.0  # every collective step's deadline (longer where an epoch needs it)
    # Over MQTT the coordinator checkpoints the ring's model every this many rounds
    # (and at the end), from the members' patches of their slices; `--resume` and a
    # re-formed ring redo at most twice this many rounds (one checkpoint in flight).
    checkpoint_every: int = 1
    # Sync: cut the gradient into buckets of about this many KB (fp32), in backward
    # order, and compress and all-reduce each while backward goes on; 0 = off.
    bucket_kb: int = 0
    # Sync: apply each agreed gradient one round late (0 = off, 1 = on), so the ring
    # all-reduce of round r's gradient runs while round r+1 computes (SEEDS D's
    # delayed update); every agent still applies the same updates.
    update_delay: int = 0
    # Model parallelism (docs/pipeline.md): cut the model into this many stages, one per
    # board; the `agents` boards form an S x D grid (D = agents / S replicas of each
    # stage, each stage's replicas in their own ring). 1 = off (data parallelism only).
    pipeline_stages: int = 1
    micro_batches: int = 4  # M: each replica's batch flows through the stages in M parts
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b (same bubble, 1f1b holds fewer activations)
    activation_dtype: str = "fp32"  # activations and their gradients on the wire: fp32 | fp16
    # How the split weighs layers: counted (multiply-adds from the shapes: the same
    # split, and the same model hash, on an idle or a loaded machine) | measured (each
    # layer's forward and backward timed here: the split may move with the load).
    pipeline_cost: str = "counted"

    def __post_init__(self) -> None:
        _check_int(self, "agents", 1, 1024)
        _check_float(self, "saving", 1.0, 1e6)
        if self.compression == "auto":  # group-top-k's settings; dense chosen per epoch
            object.__setattr__(self, "compression", "group-topk")
            object.__setattr__(self, "compression_auto", True)
        if self.density == "auto":
            _choose_density(self)
        try:  # the one codec check, shared with ReducerSettings, the Flower mod, the DDP hook
            check_codec(compression=self.compression, density=self.density,
                        group_size=self.group_size, value_dtype=self.value_dtype,
                        policy=self.policy)  # fmt: skip
        except SettingsError as exc:
            raise SpecError(f"field {exc.field!r}={exc.value!r} must be {exc.rule}") from None
        _check_choice(self, "topology", TOPOLOGIES)
        _check_choice(self, "collective", COLLECTIVES)
        _check_choice(self, "sync", SYNC_MODES)
        _check_choice(self, "lr_scaling", LR_SCALINGS)
        _check_choice(self, "init", INITS)
        _check_choice(self, "resync", RESYNCS)
        if self.task and not TASK_REF.fullmatch(self.task):
            raise SpecError(
                f"field 'task'={self.task!r} must be an entry-point name or MODULE:ATTR"
            )
        for name in (
            "local_steps",
            "rounds",
            "batch_size",
            "ref_batch",
            "eval_every",
            "async_wait",
        ):
            _check_int(self, name, 1, 10**9)
        _check_int(self, "warmup_steps", 0, 10**9)
        _check_int(self, "density_warmup", 0, 10**9)
        _check_int(self, "density_flush", 0, self.rounds)
        _check_float(self, "lr", 0.0, 100.0)
        _check_float(self, "momentum", 0.0, 0.999)
        _check_float(self, "weight_cap", 1.0, 1e9)
        _check_float(self, "staleness_power", 0.0, 10.0)
        _check_float(self, "correction", 0.0, 10.0)
        _check_float(self, "target_accuracy", 0.0, 1.0)
        _check_float(self, "timeout_s", 0.01, MAX_TIMEOUT_S)
        _check_int(self, "checkpoint_every", 1, 10**6)
        _check_int(self, "resync_every", 1, 10**6)
        _check_int(self, "bucket_kb", 0, 10**6)
        _check_int(self, "update_delay", 0, 1)
        _check_int(self, "degrade_after", 0, 1000)
        _check_int(self, "degrade_window", 1, 10**6)
        _check_float(self, "degrade_window_s", 0.0, 1e7)
        _check_int(self, "degrade_calm", 1, 10**6)
        _check_sample(self)
        _check_pipeline(self)
        if self.async_wait > self.agents:
            raise SpecError(f"async_wait={self.async_wait} exceeds agents={self.agents}")
        try:
            agg = Aggregation.parse(self.aggregation)
        except ValueError as exc:
            raise SpecError(f"field 'aggregation': {exc}") from None
        if agg.kind == "vote" and self.sync != "sync":
            raise SpecError(
                f"field 'aggregation'='vote' is signSGD: it needs sync='sync', not {self.sync!r}"
            )
        if agg.needs_star and self.topology != "star" and self.sync != "async":
            raise SpecError(
                f"field 'aggregation'={self.aggregation!r} needs every update in one place: "
                "use topology='star' or sync='async'"
            )
        if self.bucket_kb and (
            self.sync != "sync" or agg.kind not in ("mean", "weighted") or self.topology == "star"
        ):
            raise SpecError(
                f"field 'bucket_kb'={self.bucket_kb} overlaps the ring all-reduce with backward: "
                "it needs sync='sync', aggregation mean or weighted and a ring or torus, not "
                f"sync={self.sync!r}, aggregation={self.aggregation!r}, topology={self.topology!r}"
            )
        if self.update_delay and (
            self.sync != "sync" or agg.kind not in ("mean", "weighted") or self.topology == "star"
            or self.bucket_kb
        ):  # fmt: skip
            raise SpecError(
                f"field 'update_delay'={self.update_delay} runs the ring during the next "
                "round's compute: it needs sync='sync', aggregation mean or weighted, a ring or "
                f"torus and bucket_kb=0, not sync={self.sync!r}, aggregation="
                f"{self.aggregation!r}, topology={self.topology!r}, bucket_kb={self.bucket_kb}"
            )
        _check_collective(self, agg.kind)
        automatic = AUTO_LR_EF_SGD if self.plain_ef_sgd else AUTO_LR
        if self.lr == 0:  # auto, once the aggregation is known to parse
            object.__setattr__(self, "lr", automatic)
            object.__setattr__(self, "lr_auto", True)
        elif self.lr != automatic:  # a rate set over a resolved job (its lr_auto kept)
            object.__setattr__(self, "lr_auto", False)

    @property
    def compressed_sync(self) -> bool:
        """Group-top-k gradients every step (sync mode, not the sign vote)."""
        return (
            self.compression == "group-topk"
            and self.sync == "sync"
            and Aggregation.parse(self.aggregation).kind != "vote"
        )

    @property
    def plain_ef_sgd(self) -> bool:
        """Compressed sync without DGC momentum correction: SGD with no momentum."""
        return self.compressed_sync and not self.momentum_correction

    @property
    def k(self) -> int:
        return min(self.group_size, max(1, round(float(self.density) * self.group_size)))

    def codec_choice(self) -> dict[str, Any]:
        """The summary's ``codec``: the density in force, its warm-up and flush, and
        what ``density = "auto"`` chose and why (empty for a density given); under
        ``compression = "auto"`` the summary's ``collective`` epochs name each codec."""
        return {"compression": "auto" if self.compression_auto else self.compression,
                "density": self.density,
                "density_warmup": self.density_warmup, "density_flush": self.density_flush,
                "density_auto": self.density_auto}  # fmt: skip

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> JobSpec:
        """Build from a mapping (a TOML table or flags); refuse unknown keys and bad types."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise SpecError(f"unknown field {unknown[0]!r}; known fields: {', '.join(known)}")
        typed: dict[str, Any] = {}
        for name, value in values.items():
            want = type(getattr(cls(), name))
            if name == "density" and value == "auto":
                want = str
            if want is float and type(value) is int:
                value = float(value)
            if type(value) is not want:
                raise SpecError(f"field {name!r}={value!r} must be {want.__name__}")
            typed[name] = value
        return cls(**typed)

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> JobSpec:
        """Load a job file; `overrides` (from flags) win over the file."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise SpecError(f"job file {str(p)!r} does not exist") from None
        except IsADirectoryError:
            raise SpecError(f"job file {str(p)!r} is a directory, not a TOML file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"job file {str(p)!r} cannot be read: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"job file {str(p)!r} is not valid TOML: {exc}") from None
        table = data.get("job", data)
        if not isinstance(table, dict):
            raise SpecError(f"job file {str(p)!r}: [job] must be a table")
        spec = cls.from_mapping({**table, **(overrides or {})})
        _check_sample_fits(spec)
        return spec

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    def resolved(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choose_density(spec: JobSpec) -> None:
    """Resolve ``density = "auto"`` (`compression.policy`): density, warm-up, flush."""
    from fedring.compression.policy import FLOOR, choose_density
    from fedring.engine.participation import per_round

    if spec.compression == "none":
        object.__setattr__(spec, "density", FLOOR)
        object.__setattr__(spec, "density_auto", "dense: no density to choose")
        return
    _check_int(spec, "rounds", 1, 10**9)
    _check_int(spec, "agents", 1, 1024)
    sample = spec.sample  # checked later with the rest; a bad one counts as 1 here
    valid = isinstance(sample, int | float) and not isinstance(sample, bool) and sample > 0
    plan = choose_density(
        rounds=spec.rounds, local=spec.sync != "sync", saving=spec.saving,
        local_steps=spec.local_steps if type(spec.local_steps) is int and spec.local_steps > 0
        else 1,
        participation=per_round(spec.agents, sample) / spec.agents if valid else 1.0,
    )  # fmt: skip
    for name, value in plan.fields().items():
        object.__setattr__(spec, name, value)


def _check_int(spec: JobSpec, name: str, low: int, high: int) -> None:
    value = getattr(spec, name)
    if type(value) is not int or not low <= value <= high:
        raise SpecError(f"field {name!r}={value!r} must be an integer in [{low}, {high}]")


def _check_float(spec: JobSpec, name: str, low: float, high: float) -> None:
    value = getattr(spec, name)
    if not isinstance(value, (int, float)) or not low <= value <= high:
        raise SpecError(f"field {name!r}={value!r} must be a number in [{low}, {high}]")


def _check_choice(spec: JobSpec, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(spec, name)
    if value not in choices:
        raise SpecError(f"field {name!r}={value!r} must be one of {', '.join(choices)}")


def _check_collective(spec: JobSpec, kind: str) -> None:
    """A one-step collective replaces the ring of a synchronous mean: nothing else
    (``auto`` keeps the ring where it may not)."""
    if spec.collective in ("ring", "auto"):
        return
    if (spec.topology not in ("auto", "ring") or spec.sync == "async"
            or kind not in ("mean", "weighted") or spec.pipeline_stages != 1):  # fmt: skip
        raise SpecError(
            f"field 'collective'={spec.collective!r} replaces the ring's all-reduce: it needs "
            "topology auto or ring, sync other than async, aggregation mean or weighted and "
            f"pipeline_stages=1, not topology={spec.topology!r}, sync={spec.sync!r}, "
            f"aggregation={spec.aggregation!r}, pipeline_stages={spec.pipeline_stages}"
        )


def _check_sample(spec: JobSpec) -> None:
    """`sample`: a fraction in (0, 1] or a whole number of agents; only a star samples."""
    from fedring.engine.participation import SitOut, per_round

    value = spec.sample
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"field 'sample'={value!r} must be a number")
    if not (0 < value <= 1 or (value >= 2 and float(value).is_integer())):
        raise SpecError(
            f"field 'sample'={value!r} must be a fraction in (0, 1] of the agents or a whole "
            "number >= 2 of them"
        )
    try:
        SitOut.parse(spec.sit_out)
    except ValueError as exc:
        raise SpecError(f"field 'sit_out': {exc}") from None
    if per_round(spec.agents, value) == spec.agents:
        return
    kind = Aggregation.parse(spec.aggregation).kind
    if spec.topology != "star" or spec.sync not in ("sync", "local") or kind not in (
        "mean", "median", "trimmed", "clip"
    ):  # fmt: skip
        raise SpecError(
            f"field 'sample'={value!r} trains a sample of the agents each round, which needs "
            "a centre that sends every agent the result: topology='star', sync 'sync' or "
            "'local' and aggregation mean, median, trimmed:B or clip (the sample's updates "
            "count alike), not "
            f"topology={spec.topology!r}, sync={spec.sync!r}, aggregation={spec.aggregation!r}"
        )


def _check_sample_fits(spec: JobSpec) -> None:
    """A job's whole-number `sample` may not ask for more agents a round than the job
    has: `sample = 7` of 4 would train all 4 every round, silently. Checked where a user
    writes the job (its file, flags over it), not in `__post_init__`: a coordinator
    that starts with fewer agents (``--min-agents``) says so in its summary instead."""
    if spec.sample > 1 and spec.sample > spec.agents:
        raise SpecError(
            f"field 'sample'={spec.sample:g} asks for more agents a round than the job's "
            f"agents={spec.agents}: give at most {spec.agents}, or a fraction in (0, 1]"
        )


def _check_pipeline(spec: JobSpec) -> None:
    """Pipeline fields: ranges, and a job the S x D grid can run."""
    _check_int(spec, "pipeline_stages", 1, 64)
    _check_int(spec, "micro_batches", 1, 4096)
    _check_choice(spec, "pipeline_schedule", PIPELINE_SCHEDULES)
    _check_choice(spec, "activation_dtype", ACTIVATION_DTYPES)
    _check_choice(spec, "pipeline_cost", PIPELINE_COSTS)
    s = spec.pipeline_stages
    if s == 1:
        return
    if spec.agents % s:
        raise SpecError(f"field 'agents'={spec.agents} must be a multiple of pipeline_stages={s} "
                        "(S stages x D replicas of each)")  # fmt: skip
    if spec.micro_batches > spec.batch_size:
        raise SpecError(f"field 'micro_batches'={spec.micro_batches} exceeds batch_size="
                        f"{spec.batch_size}: a micro-batch needs at least one row")  # fmt: skip
    plain = {"sync": "sync", "topology": "auto", "aggregation": "mean", "bucket_kb": 0,
             "update_delay": 0, "sample": 1.0}  # fmt: skip
    for name, want in plain.items():
        if getattr(spec, name) != want and not (name == "topology" and spec.topology == "ring"):
            raise SpecError(f"field 'pipeline_stages'={s} runs synchronous steps with mean "
                            f"stage rings: it needs {name}={want!r}, not "
                            f"{getattr(spec, name)!r}")  # fmt: skip
