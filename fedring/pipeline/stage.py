"""One pipeline stage: its layers, and the frames it exchanges with its neighbours.

A forward takes a micro-batch's input (the data on stage 0, else the activation
the previous stage sent), runs the stage's layers, keeps input and output for the
backward, and sends the output on. A backward takes the gradient of the output
(the loss on the last stage, else the gradient the next stage sent), runs
autograd through the stage, and sends the gradient of the input back. Parameter
gradients accumulate over the step's micro-batches, as in single-process
gradient accumulation.

Activations and their gradients travel as dense payloads (fp32, or fp16 to halve
the bytes) through the stage's `PeerChannel`: signed, hash-checked frames, phase
``pp-act`` or ``pp-grad`` at (round = step, step = micro-batch). The receiver
knows how many entries to expect (rows x the stage's input shape) and refuses
anything else before allocating; every wait has the settings' deadline, and a
silent or lost neighbour ends it with the channel's `CollectiveTimeout` or
`PeerLost`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from fedring.collective.channel import PeerChannel
from fedring.compression.payload import Payload, PayloadLimits
from fedring.compression.quantize import DenseCodec
from fedring.pipeline.schedule import Op
from fedring.transport.base import Deadline
from fedring.wire.errors import FrameError, FrameReason

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ACT, GRAD = "pp-act", "pp-grad"


FP16_MAX = 65504.0


class NonFiniteActivation(ArithmeticError):
    """An activation or gradient to send holds NaN or Inf (training diverged): the
    receiver would refuse it and wait to its deadline, so the sender stops at once,
    saying where."""


@dataclass(frozen=True)
class WireSettings:
    """How a stage's activations and gradients travel."""

    dtype: Literal["fp32", "fp16"] = "fp32"  # fp16 halves the bytes; fp32 is exact
    timeout_s: float = 60.0  # deadline of every wait for a neighbour


@dataclass
class Stage:
    """Stage `index` of `count`, with its neighbours' endpoint names."""

    index: int
    count: int
    module: nn.Module
    channel: PeerChannel
    prev: str | None  # None on the first stage
    next: str | None  # None on the last stage
    in_shape: tuple[int, ...]  # one sample's input (ignored on the first stage)
    loss_fn: LossFn | None = None  # the last stage's loss
    wire: WireSettings = field(default_factory=WireSettings)
    payload_bytes_sent: int = 0  # activations and gradients, as they went in bodies
    # CPU seconds of this thread (torch runs single-threaded here): compute only,
    # never a wait for a neighbour nor another thread's turn
    forward_s: float = 0.0  # the forwards so far
    backward_s: float = 0.0  # the backwards so far
    micro_run: int = 0  # forwards run so far
    _saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def _send(self, dst: str, t: torch.Tensor, step: int, micro: int, phase: str) -> None:
        flat = t.detach().reshape(-1)
        peak = float(flat.abs().max()) if flat.numel() else 0.0
        if not math.isfinite(peak):
            raise NonFiniteActivation(
                f"stage {self.index}: the {phase} of micro-batch {micro}, step {step}, holds "
                "NaN or Inf"
            )
        if self.wire.dtype == "fp16" and peak > FP16_MAX:  # the codec clamps: count it
            self.channel.counters.add(f"{phase}_fp16_clamped")
        payload = DenseCodec(self.wire.dtype).compress(flat)
        self.channel.send(dst, payload, round=step, step=micro, phase=phase,
                          deadline=Deadline.after(self.wire.timeout_s))  # fmt: skip
        self.payload_bytes_sent += payload.wire_nbytes
        self.channel.counters.add(f"{phase}_sent")

    def _recv(self, src: str, shape: tuple[int, ...], step: int, micro: int,
              phase: str) -> torch.Tensor:  # fmt: skip
        numel = math.prod(shape)

        def accept(p: Payload) -> None:
            if p.numel != numel:
                raise FrameError(
                    FrameReason.SHAPE_MISMATCH,
                    f"{phase} of {p.numel} entries, expected {numel} = {shape}",
                )

        payload = self.channel.recv(
            src, round=step, step=micro, phase=phase, accept=accept,
            deadline=Deadline.after(self.wire.timeout_s), limits=PayloadLimits(max_numel=numel),
        )  # fmt: skip
        return payload.decompress().view(shape)

    def forward(self, step: int, micro: int, rows: int, x: torch.Tensor | None = None) -> None:
        """Forward of micro-batch `micro` (`x`: its data, on the first stage only)."""
        if self.first:
            if x is None:
                raise ValueError("the first stage needs the micro-batch's data")
            inp = x
        else:
            assert self.prev is not None
            inp = self._recv(self.prev, (rows, *self.in_shape), step, micro, ACT)
            inp.requires_grad_(True)
        start = time.thread_time()
        out = self.module(inp)
        self.forward_s += time.thread_time() - start
        self.micro_run += 1
        self._saved[micro] = (inp, out)
        if self.next is not None:
            self._send(self.next, out, step, micro, ACT)

    def backward(
        self, step: int, micro: int, y: torch.Tensor | None = None, scale: float = 1.0
    ) -> float | None:
        """Backward of micro-batch `micro`; on the last stage, the loss of its
        targets `y` times `scale` (returned unscaled)."""
        inp, out = self._saved.pop(micro)
        loss = None
        if self.last:
            if y is None or self.loss_fn is None:
                raise ValueError("the last stage needs the loss and the micro-batch's targets")
            start = time.thread_time()
            value = self.loss_fn(out, y)
            (value * scale).backward()
            self.backward_s += time.thread_time() - start
            loss = float(value.detach())
        else:
            assert self.next is not None
            grad = self._recv(self.next, tuple(out.shape), step, micro, GRAD)
            start = time.thread_time()
            if out.requires_grad:
                out.backward(grad)
            self.backward_s += time.thread_time() - start
        if self.prev is not None:
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._send(self.prev, g, step, micro, GRAD)
        return loss

    def run(
        self, step: int, ops: Sequence[Op], rows: Sequence[int],
        xs: Sequence[torch.Tensor] | None = None, ys: Sequence[torch.Tensor] | None = None,
    ) -> list[float]:  # fmt: skip
        """One step's `ops`; micro-batch m has `rows[m]` rows (data `xs[m]` on the first
        stage, targets `ys[m]` on the last). Returns the last stage's losses."""
        total = sum(rows)
        losses = []
        for op in ops:
            m = op.micro
            if op.kind == "F":
                self.forward(step, m, rows[m], xs[m] if xs is not None else None)
            else:
                loss = self.backward(step, m, ys[m] if ys is not None else None, rows[m] / total)
                if loss is not None:
                    losses.append(loss)
        if self._saved:
            raise RuntimeError(f"stage {self.index}: micro-batches {sorted(self._saved)} "
                               "were never run backward")  # fmt: skip
        return losses
