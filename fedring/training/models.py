"""Models for fedring training, built from a spec string and seen as one flat vector.

`build_model` turns a spec into a seeded `torch.nn.Module`:

- ``"mlp"``: two hidden ReLU layers (128, 64) over the flattened features;
  ``"mlp:W1xW2x..."`` sets the hidden widths (``"mlp:512x512"``: 300 k parameters
  on digits, a model whose dense exchange costs seconds on a 10 Mbit/s link);
- ``"cnn"``: a small 2-D CNN for ``(C, H, W)`` features (the 8x8 digits), or the
  MNIST-1D paper's 1-D CNN for ``(C, L)`` features;
- ``"MODULE:FACTORY"``: ``FACTORY(feature_shape=..., num_classes=...)`` imported
  from ``MODULE``, for models fedring does not ship.

Every agent builds its model from the same seed, so all replicas start bit-for-bit
equal; `params_sha256` checks that cheaply. The global RNG is never disturbed.

The flat-vector helpers read and write all parameters (or gradients) as one float32
vector in `model.parameters()` order, the layout compression and the ring work on.

    >>> model = build_model("mlp", (1, 8, 8), 10, seed=0)
    >>> flat_params(model).shape == (param_count(model),)
    True
"""

from __future__ import annotations

import hashlib
import importlib
import math
import threading
from collections.abc import Callable, Iterable

import torch
from torch import nn

SPECS = ("mlp", "mlp:W1xW2...", "cnn", "MODULE:FACTORY")

_Builder = Callable[[tuple[int, ...], int], nn.Sequential]
_GLOBAL_RNG = threading.RLock()  # held while a build seeds and draws from torch's generator


class ModelError(ValueError):
    """A model spec that cannot be built: unknown name, unfit shape or broken factory."""


def _mlp(
    feature_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...] = (128, 64)
) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    fan_in = math.prod(feature_shape)
    for width in widths:
        layers += [nn.Linear(fan_in, width), nn.ReLU()]
        fan_in = width
    return nn.Sequential(*layers, nn.Linear(fan_in, num_classes))


def mlp_widths(spec: str) -> tuple[int, ...]:
    """Hidden widths of ``"mlp:W1xW2..."``.

    >>> mlp_widths("mlp:512x256")
    (512, 256)
    """
    text = spec.removeprefix("mlp:")
    try:
        widths = tuple(int(w) for w in text.split("x"))
    except ValueError:
        widths = ()
    if not widths or not all(1 <= w <= 65536 for w in widths) or len(widths) > 8:
        raise ModelError(f"model spec {spec!r}: expected mlp:W1xW2... with 1 to 8 widths in "
                         "[1, 65536], e.g. mlp:512x512")  # fmt: skip
    return widths


def _cnn2d(channels: int, height: int, width: int, num_classes: int) -> nn.Sequential:
    if height < 2 or width < 2:
        raise ModelError(f"feature_shape={(channels, height, width)}: cnn needs H, W >= 2")
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 2) * (width // 2), 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def _cnn1d(channels: int, length: int, num_classes: int) -> nn.Sequential:
    # The ConvBase of the MNIST-1D paper (Greydanus 2020, "Scaling down deep learning",
    # arXiv:2011.14439; github.com/greydanus/mnist1d), about 94% test accuracy there:
    # three Conv1d layers of 25 channels, stride 2, padding 1, kernels 5, 3, 3, each
    # followed by ReLU, then one Linear on the flattened features (25 * 5 = 125 for L = 40).
    out = length
    for kernel in (5, 3, 3):
        out = (out + 2 - kernel) // 2 + 1
    if out < 1:
        raise ModelError(f"feature_shape={(channels, length)}: cnn needs L >= 3, got L={length}")
    return nn.Sequential(
        nn.Conv1d(channels, 25, 5, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(25, 25, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(25, 25, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(25 * out, num_classes),
    )


def _cnn(feature_shape: tuple[int, ...], num_classes: int) -> nn.Sequential:
    if len(feature_shape) == 3:
        return _cnn2d(*feature_shape, num_classes)
    if len(feature_shape) == 2:
        return _cnn1d(*feature_shape, num_classes)
    raise ModelError(
        f"feature_shape={feature_shape}: cnn needs (C, H, W) or (C, L), "
        f"got rank {len(feature_shape)}"
    )


_BUILTIN: dict[str, _Builder] = {"mlp": _mlp, "cnn": _cnn}


def _init_weights(model: nn.Sequential) -> None:
    """He init for layers feeding a ReLU, Xavier for the rest (the logits), zero biases."""
    layers = list(model)
    for i, layer in enumerate(layers):
        if not isinstance(layer, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            continue
        if i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        else:
            nn.init.xavier_uniform_(layer.weight)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)


def factory_module(spec: str) -> str | None:
    """The module `build_model` imports for `spec` (``MODULE:FACTORY``); None for a
    built-in model, which imports nothing.

    >>> factory_module("my_models:small"), factory_module("mlp:64x32")
    ('my_models', None)
    """
    if spec in _BUILTIN or spec.startswith("mlp:") or ":" not in spec:
        return None
    return spec.partition(":")[0]


def _from_factory(spec: str, feature_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise ModelError(f"model spec {spec!r}: expected MODULE:FACTORY with both parts")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"model spec {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelError(f"model spec {spec!r}: {module_name} has no callable {factory_name!r}")
    model = factory(feature_shape=feature_shape, num_classes=num_classes)
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model spec {spec!r}: factory returned {type(model).__name__}, not torch.nn.Module"
        )
    return model


def build_model(
    spec: str, feature_shape: tuple[int, ...], num_classes: int, seed: int
) -> nn.Module:
    """Build the model named by `spec`, initialised deterministically from `seed`.

    Parameters
    ----------
    spec : str
        ``"mlp"``, ``"cnn"`` or ``"MODULE:FACTORY"``.
    feature_shape : tuple of int
        Shape of one example, without the batch dimension: ``(1, 8, 8)`` for digits,
        ``(1, 40)`` for MNIST-1D.
    num_classes : int
        Number of output logits.
    seed : int
        Same seed, bitwise-identical parameters. Built under `torch.random.fork_rng`,
        so the caller's global RNG state is left as it was.

    Returns
    -------
    torch.nn.Module
        Built-in models use He-normal init before each ReLU, Xavier-uniform on the
        output layer and zero biases; factory models keep their own init.

    Raises
    ------
    ModelError
        Unknown spec, a feature shape the model cannot take, or a factory that
        cannot be imported or does not return a module.
    """
    shape = tuple(int(d) for d in feature_shape)
    if not shape or min(shape) < 1:
        raise ModelError(f"feature_shape={feature_shape}: need at least one dimension, all >= 1")
    if num_classes < 1:
        raise ModelError(f"num_classes={num_classes} must be >= 1")
    builder = _BUILTIN.get(spec)
    if spec.startswith("mlp:"):
        widths = mlp_widths(spec)
        builder = lambda shape, classes: _mlp(shape, classes, widths)  # noqa: E731
    if builder is None and ":" not in spec:
        raise ModelError(f"model spec {spec!r} is unknown; expected one of {', '.join(SPECS)}")
    # torch's global generator is one per process, shared by threads: members built on
    # threads at once (the library's `plan` in each) seeded and drew from it in turn, and
    # one run in eight started from another model. Builds take turns.
    with _GLOBAL_RNG, torch.random.fork_rng():
        torch.manual_seed(seed)
        if builder is None:
            return _from_factory(spec, shape, num_classes)
        model = builder(shape, num_classes)
        _init_weights(model)
    return model


Params = nn.Module | Iterable[torch.Tensor]  # a model, or its parameters in a chosen order


def _params(src: Params) -> list[torch.Tensor]:
    return list(src.parameters()) if isinstance(src, nn.Module) else list(src)


def param_count(model: Params) -> int:
    """Number of scalar parameters: the length of the flat vector."""
    return sum(p.numel() for p in _params(model))


def flat_params(model: Params) -> torch.Tensor:
    """Return a new float32 1-D copy of all parameters, in `model.parameters()` order
    (or in the order of the given tensors)."""
    parts = [p.detach().reshape(-1).to(torch.float32) for p in _params(model)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


def flat_grads(model: Params) -> torch.Tensor:
    """Return a new float32 1-D copy of all gradients, in `flat_params` order.

    A parameter whose ``.grad`` is None (unused this step) contributes zeros.
    """
    parts = [
        torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if p.grad is None
        else p.grad.detach().reshape(-1).to(torch.float32)
        for p in _params(model)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


def _chunks(params: list[torch.Tensor], flat: torch.Tensor, what: str) -> list[torch.Tensor]:
    """Split `flat` into one view per parameter, checking its rank and length."""
    if flat.dim() != 1:
        raise ValueError(f"flat {what} must be 1-D, got shape {tuple(flat.shape)}")
    sizes = [p.numel() for p in params]
    if flat.numel() != sum(sizes):
        raise ValueError(
            f"flat {what} has length {flat.numel()}, the model has {sum(sizes)} parameters"
        )
    return list(torch.split(flat, sizes)) if sizes else []


def set_flat_params(model: Params, flat: torch.Tensor) -> None:
    """Copy `flat` (layout of `flat_params`) into the parameters, in place.

    Raises
    ------
    ValueError
        If `flat` is not 1-D or its length differs from `param_count(model)`.
    """
    params = _params(model)
    with torch.no_grad():
        for p, chunk in zip(params, _chunks(params, flat, "params"), strict=True):
            p.copy_(chunk.reshape(p.shape))


def set_flat_grads(model: Params, flat: torch.Tensor) -> None:
    """Copy `flat` (layout of `flat_grads`) into each parameter's ``.grad``.

    The gradients are copies: later changes to `flat` do not reach the model.

    Raises
    ------
    ValueError
        If `flat` is not 1-D or its length differs from `param_count(model)`.
    """
    params = _params(model)
    for p, chunk in zip(params, _chunks(params, flat, "grads"), strict=True):
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(chunk.reshape(p.shape))


def params_sha256(model: nn.Module) -> str:
    """Hex sha256 of `flat_params` as little-endian float32 bytes.

    Equal digests mean bitwise-equal replicas; used to check agents start (and stay) in sync.
    """
    return flat_sha256(flat_params(model))


def flat_sha256(flat: torch.Tensor) -> str:
    """Hex sha256 of a flat float32 vector's little-endian bytes (see `params_sha256`)."""
    return hashlib.sha256(flat_bytes(flat)).hexdigest()


def flat_bytes(flat: torch.Tensor) -> bytes:
    return flat.detach().cpu().numpy().astype("<f4", copy=False).tobytes()


def pay_process_one_offs() -> None:
    """Pay, before any job's clock starts, what only the first job in a process pays.

    The first torch optimizer built in a process imports ``torch._dynamo`` (~2 s on
    a 2-core sandbox). A process that runs several jobs (``simulate --with-dense``,
    the benches, an agent daemon) would otherwise charge it to whichever job ran
    first: `fedring simulate` calls this before its clock starts (with the
    once-generated MNIST-1D in ``setup_seconds``), an agent daemon before its
    first hello.
    Later calls cost microseconds.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
