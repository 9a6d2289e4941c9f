"""Models: output shapes, seeded init, untouched global RNG, flat views, factory specs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedring.training.models import (
    ModelError,
    build_model,
    flat_grads,
    flat_params,
    param_count,
    params_sha256,
    set_flat_grads,
    set_flat_params,
)

DIGITS = (1, 8, 8)
MNIST1D = (1, 40)


def tiny_factory(feature_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A user model for the MODULE:FACTORY spec; its init draws from the global RNG."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(int(torch.tensor(feature_shape).prod()), num_classes)
    )


def not_a_module(feature_shape: tuple[int, ...], num_classes: int) -> object:
    return [feature_shape, num_classes]


NOT_CALLABLE = 3


@pytest.mark.parametrize(
    ("spec", "shape"),
    [("mlp", DIGITS), ("mlp", MNIST1D), ("cnn", DIGITS), ("cnn", MNIST1D)],
)
def test_output_shape_is_batch_by_classes(spec: str, shape: tuple[int, ...]) -> None:
    model = build_model(spec, shape, 10, seed=0)
    assert model(torch.randn(5, *shape)).shape == (5, 10)


def test_cnn_1d_is_the_mnist1d_paper_convbase() -> None:
    model = build_model("cnn", MNIST1D, 10, seed=0)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv1d)]
    assert [(c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (25, (5,), (2,), (1,)),
        (25, (3,), (2,), (1,)),
        (25, (3,), (2,), (1,)),
    ]
    linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    assert linear.in_features == 125  # 25 channels x length 5, as in the paper's code
    # conv weights 25*1*5 + 2*25*25*3, biases 3*25, linear 125*10 + 10
    assert param_count(model) == 125 + 3750 + 75 + 1260


def test_cnn_2d_layout_for_digits() -> None:
    model = build_model("cnn", DIGITS, 10, seed=0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(32 * 4 * 4, 64), (64, 10)]


@pytest.mark.parametrize("spec", ["mlp", "cnn"])
def test_init_is_he_before_relu_xavier_on_logits_zero_bias(spec: str) -> None:
    model = build_model(spec, DIGITS, 10, seed=0)
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    for layer in layers:
        assert layer.bias is not None and not layer.bias.any()
    last = layers[-1]
    fan_in, fan_out = last.weight.shape[1], last.weight.shape[0]
    bound = (6 / (fan_in + fan_out)) ** 0.5
    assert float(last.weight.detach().abs().max()) <= bound
    first = layers[0]
    fan_in_first = first.weight[0].numel()
    std = float(first.weight.detach().std())
    assert 0.7 * (2 / fan_in_first) ** 0.5 < std < 1.3 * (2 / fan_in_first) ** 0.5


@pytest.mark.parametrize(("spec", "shape"), [("mlp", DIGITS), ("cnn", DIGITS), ("cnn", MNIST1D)])
def test_same_seed_same_params_other_seed_different(spec: str, shape: tuple[int, ...]) -> None:
    a = build_model(spec, shape, 10, seed=7)
    b = build_model(spec, shape, 10, seed=7)
    c = build_model(spec, shape, 10, seed=8)
    assert params_sha256(a) == params_sha256(b)
    assert torch.equal(flat_params(a), flat_params(b))
    assert params_sha256(a) != params_sha256(c)


@pytest.mark.parametrize("spec", ["mlp", "cnn", "tests.training.test_models:tiny_factory"])
def test_building_leaves_global_rng_untouched(spec: str) -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    build_model(spec, DIGITS, 10, seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_params_sha256_is_sha_of_little_endian_float32() -> None:
    import hashlib

    model = build_model("mlp", MNIST1D, 3, seed=0)
    expected = hashlib.sha256(flat_params(model).numpy().astype("<f4").tobytes()).hexdigest()
    assert params_sha256(model) == expected
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1.0
    assert params_sha256(model) != expected


def test_flat_params_is_a_float32_copy_in_parameters_order() -> None:
    model = build_model("cnn", MNIST1D, 10, seed=0)
    flat = flat_params(model)
    assert flat.dtype == torch.float32 and flat.dim() == 1
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    flat.zero_()
    assert any(p.abs().sum() > 0 for p in model.parameters())


def test_set_flat_params_round_trip() -> None:
    model = build_model("mlp", DIGITS, 10, seed=0)
    new = torch.arange(param_count(model), dtype=torch.float32) / 1000
    set_flat_params(model, new)
    assert torch.equal(flat_params(model), new)
    other = build_model("mlp", DIGITS, 10, seed=1)
    set_flat_params(other, flat_params(model))
    assert params_sha256(other) == params_sha256(model)


@pytest.mark.parametrize("delta", [-1, 1])
def test_set_flat_params_wrong_length_names_both_lengths(delta: int) -> None:
    model = build_model("mlp", MNIST1D, 10, seed=0)
    n = param_count(model)
    with pytest.raises(ValueError, match=rf"length {n + delta}.*{n} parameters"):
        set_flat_params(model, torch.zeros(n + delta))


def test_set_flat_params_rejects_non_flat() -> None:
    model = build_model("mlp", MNIST1D, 10, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        set_flat_params(model, torch.zeros(1, param_count(model)))


def test_flat_grads_after_backward_equals_concatenated_grads() -> None:
    model = build_model("cnn", DIGITS, 10, seed=0)
    assert not flat_grads(model).any()  # no backward yet: all .grad are None
    loss = nn.functional.cross_entropy(model(torch.randn(5, *DIGITS)), torch.arange(5))
    loss.backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert torch.equal(flat_grads(model), expected)


def test_flat_grads_zeros_where_grad_is_none() -> None:
    model = build_model("mlp", MNIST1D, 4, seed=0)
    last = list(model.parameters())[-1]
    last.sum().backward()
    grads = flat_grads(model)
    assert torch.equal(grads[-4:], torch.ones(4))
    assert not grads[:-4].any()


def test_set_flat_grads_round_trip_and_copies() -> None:
    model = build_model("mlp", MNIST1D, 10, seed=0)
    flat = torch.randn(param_count(model))
    set_flat_grads(model, flat)
    assert torch.equal(flat_grads(model), flat)
    flat.zero_()
    assert flat_grads(model).any()
    with pytest.raises(ValueError, match="length 3"):
        set_flat_grads(model, torch.zeros(3))


def test_factory_spec_builds_seeded_user_model() -> None:
    spec = "tests.training.test_models:tiny_factory"
    a = build_model(spec, DIGITS, 3, seed=5)
    b = build_model(spec, DIGITS, 3, seed=5)
    c = build_model(spec, DIGITS, 3, seed=6)
    assert a(torch.randn(5, *DIGITS)).shape == (5, 3)
    assert params_sha256(a) == params_sha256(b) != params_sha256(c)
    # the factory keeps its own init: PyTorch's default Linear init has nonzero biases
    assert list(a.parameters())[-1].abs().sum() > 0


@pytest.mark.parametrize(
    "spec",
    [
        "tests.training.no_such_module:tiny_factory",
        "tests.training.test_models:no_such_factory",
        "tests.training.test_models:NOT_CALLABLE",
        "tests.training.test_models:not_a_module",
        ":tiny_factory",
        "tests.training.test_models:",
    ],
)
def test_broken_factory_spec_names_the_spec(spec: str) -> None:
    with pytest.raises(ModelError, match=spec.replace(".", r"\.")):
        build_model(spec, DIGITS, 3, seed=0)


def test_unknown_spec_lists_the_choices() -> None:
    with pytest.raises(ModelError, match=r"'resnet'.*mlp, mlp:W1xW2..., cnn, MODULE:FACTORY"):
        build_model("resnet", DIGITS, 10, seed=0)


@pytest.mark.parametrize("shape", [(40,), (1, 1, 8, 8)])
def test_cnn_wrong_rank_names_feature_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ModelError, match=r"feature_shape=.*rank"):
        build_model("cnn", shape, 10, seed=0)


@pytest.mark.parametrize("shape", [(1, 2), (1, 1, 8)])
def test_cnn_too_small_input_names_feature_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ModelError, match="feature_shape="):
        build_model("cnn", shape, 10, seed=0)


def test_bad_num_classes_and_empty_shape_are_model_errors() -> None:
    with pytest.raises(ModelError, match="num_classes=0"):
        build_model("mlp", DIGITS, 0, seed=0)
    with pytest.raises(ModelError, match="feature_shape="):
        build_model("mlp", (1, 0), 10, seed=0)


def test_mlp_widths_set_the_hidden_layers() -> None:
    model = build_model("mlp:512x512", (1, 8, 8), 10, seed=0)
    assert param_count(model) == 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert params_sha256(build_model("mlp:128x64", (1, 8, 8), 10, 0)) == params_sha256(
        build_model("mlp", (1, 8, 8), 10, 0)
    )


@pytest.mark.parametrize("spec", ["mlp:", "mlp:0x5", "mlp:12a", "mlp:" + "x".join(["4"] * 9)])
def test_bad_mlp_widths_are_refused_with_the_spec(spec: str) -> None:
    with pytest.raises(ModelError, match="mlp:W1xW2"):
        build_model(spec, (1, 8, 8), 10, seed=0)


def test_models_built_on_threads_at_once_are_the_seeds_models() -> None:
    """torch's global generator is shared by threads: builds that seed and draw from it
    at the same time took each other's numbers (one library run in eight began from
    another model). They take turns."""
    import threading

    from fedring.training.models import build_model, params_sha256

    want = params_sha256(build_model("mlp", (1, 8, 8), 10, seed=0))
    start = threading.Barrier(6)
    got: list[str] = []

    def builds() -> None:
        start.wait()
        got.extend(params_sha256(build_model("mlp", (1, 8, 8), 10, seed=0)) for _ in range(30))

    threads = [threading.Thread(target=builds) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got.count(want) == len(got) == 180
