"""Bad input and unsupported models get clear errors; weights are never silently corrupted."""

import math

import pytest
import torch
from torch import nn

import dpoptim
from dpoptim import UnsupportedLayerError


def make_opt(params, **overrides):
    kwargs = dict(lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, sample_rate=0.1)
    kwargs.update(overrides)
    return dpoptim.DPSGD(params, **kwargs)


@pytest.mark.parametrize(
    "overrides, argument",
    [
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=math.nan), "noise_multiplier"),
        (dict(noise_multiplier=math.inf), "noise_multiplier"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_grad_norm=-2.0), "max_grad_norm"),
        (dict(max_grad_norm=math.inf), "max_grad_norm"),
        (dict(max_grad_norm=math.nan), "max_grad_norm"),
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(sample_rate=1.5), "sample_rate"),
        (dict(sample_rate=math.nan), "sample_rate"),
        (dict(loss_reduction="avg"), "loss_reduction"),
        (dict(expected_batch_size=0), "expected_batch_size"),
        (dict(expected_batch_size=math.nan), "expected_batch_size"),
        (dict(delta=1.0), "delta"),
        (dict(delta=0.0), "delta"),
        (dict(accountant="moments"), "accountant"),
        (dict(sample_rate=None), "sample_rate"),
        (dict(expected_batch_size=None), "expected_batch_size"),
        (dict(dataset_size=0), "dataset_size"),
        (dict(max_epsilon=-1.0), "max_epsilon"),
    ],
)
def test_invalid_hyperparameters_name_the_argument(overrides, argument):
    with pytest.raises(ValueError, match=argument):
        make_opt(nn.Linear(2, 2).parameters(), **overrides)


def test_setting_invalid_values_later_is_refused():
    opt = make_opt(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="noise_multiplier"):
        opt.noise_multiplier = -0.5
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.max_grad_norm = 0
    opt.sample_rate = 2.0
    with pytest.raises(ValueError, match="sample_rate"):
        opt.step()


def test_defaults_follow_from_dataset_size():
    opt = make_opt(nn.Linear(2, 2).parameters(), expected_batch_size=None, sample_rate=0.01, dataset_size=1000)
    assert opt.expected_batch_size == pytest.approx(10)
    opt = make_opt(nn.Linear(2, 2).parameters(), sample_rate=None, expected_batch_size=50, dataset_size=1000)
    assert opt.sample_rate == pytest.approx(0.05)


class Mixing(nn.Module):
    """A custom layer without a rule whose own parameter meets the batch in an einsum:
    nothing says which part of its gradient belongs to which example."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3, 3, 2))

    def forward(self, x):
        return torch.einsum("ni,ijk->njk", x, self.gain)


def test_layer_that_cannot_be_split_fails_naming_path_class_parameter_and_fix():
    model = nn.Sequential(nn.Linear(4, 3), Mixing())
    before = [p.detach().clone() for p in model.parameters()]
    opt = make_opt(model.parameters())
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"'gain' of `1` \(test_errors.Mixing\) meets the batch in `einsum`.*register_rule"):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert opt.ledger == ()


class RawUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        # the Linear's weight is also used in a functional call no rule sees
        return self.lin(x) + nn.functional.linear(x, self.lin.weight)


def test_parameter_reused_outside_its_module_is_detected():
    model = RawUse()
    opt = make_opt(model.parameters())
    opt.zero_grad()
    model(torch.randn(5, 4)).square().sum().backward()
    with pytest.raises(UnsupportedLayerError, match="differs from autograd"):
        opt.step()


def test_loss_term_on_the_weights_is_detected():
    model = nn.Linear(4, 2)
    opt = make_opt(model.parameters())
    opt.zero_grad()
    (model(torch.randn(5, 4)).square().mean() + model.weight.square().sum()).backward()
    with pytest.raises(UnsupportedLayerError, match="weight_decay"):
        opt.step()


@pytest.mark.parametrize("bn", [nn.BatchNorm1d(3), nn.SyncBatchNorm(3)])
def test_batchnorm_in_training_mode_is_refused(bn):
    model = nn.Sequential(nn.Linear(4, 3), bn, nn.Linear(3, 1))
    opt = make_opt(model.parameters())
    opt.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(UnsupportedLayerError, match=f"{type(bn).__name__}.*replace_batchnorm"):
        opt.step()


def test_frozen_batchnorm_in_training_mode_is_still_refused():
    bn = nn.BatchNorm1d(3)
    bn.requires_grad_(False)
    model = nn.Sequential(nn.Linear(4, 3), bn, nn.Linear(3, 1))
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    opt.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(UnsupportedLayerError, match="batch statistics"):
        opt.step()


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("zero_grad_after_forward", [False, True])
def test_batchnorm_on_the_input_with_nothing_to_train_is_still_refused(affine, zero_grad_after_forward):
    """A BatchNorm on the input whose own parameters do not train (frozen, or affine=False)
    has no gradient to carry the refusal back, yet the layers after it read mixed examples:
    removing one example moves every other one's gradient. The next backward is refused,
    also in a loop that clears the gradients between forward and backward."""
    bn = nn.BatchNorm1d(4, affine=affine)
    bn.requires_grad_(False)
    model = nn.Sequential(bn, nn.Linear(4, 1))
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    if not zero_grad_after_forward:
        opt.zero_grad()
    loss = model(torch.randn(5, 4)).sum()
    if zero_grad_after_forward:
        opt.zero_grad()
    loss.backward()
    before = model[1].weight.detach().clone()
    with pytest.raises(UnsupportedLayerError, match="batch statistics"):
        opt.step()
    assert torch.equal(model[1].weight, before)


def test_replace_batchnorm_swaps_for_groupnorm():
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.Sequential(nn.BatchNorm1d(3)))
    dpoptim.replace_batchnorm(model)
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 32 and model[1].num_channels == 64
    assert isinstance(model[2][0], nn.GroupNorm) and model[2][0].num_groups == 1
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_non_finite_example_is_dropped_with_a_warning_and_step_still_happens():
    model = nn.Linear(3, 1, bias=False).double()
    nn.init.ones_(model.weight)
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=10.0,
                        expected_batch_size=1, sample_rate=0.1)
    x = torch.tensor([[1.0, 2.0, 3.0], [math.inf, 0.0, 0.0], [math.nan, 1.0, 1.0]], dtype=torch.float64)
    opt.zero_grad()
    with pytest.warns(dpoptim.PrivacyWarning, match="2 example"):
        model(x).mean().backward()
    opt.step()
    # only the first example counts: its gradient is x_0 (norm < C, unclipped)
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64))
    assert opt.ledger == ((0.0, 0.1, 1),)


def test_changing_max_grad_norm_between_backward_and_step_is_refused():
    model = nn.Linear(3, 1)
    opt = make_opt(model.parameters())
    opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.max_grad_norm = 2.0
    with pytest.raises(ValueError, match="max_grad_norm changed"):
        opt.step()


@pytest.mark.parametrize("later_step", [False, True])
@pytest.mark.parametrize("layer", ["linear", "lstm"])
def test_backward_twice_through_one_forward_is_refused(layer, later_step):
    """On the first step and later (when the first backward has released what the rules
    saved, and the LSTM's rule stands in for its backward), by backward() or step()."""
    model = nn.Linear(3, 1) if layer == "linear" else nn.LSTM(3, 2, batch_first=True)
    opt = make_opt(model.parameters())

    def loss():
        out = model(torch.randn(4, 5, 3) if layer == "lstm" else torch.randn(4, 3))
        return (out[0] if layer == "lstm" else out).sum()

    if later_step:
        loss().backward()
        opt.step()
    opt.zero_grad()
    out = loss()
    out.backward(retain_graph=True)
    with pytest.raises((UnsupportedLayerError, RuntimeError), match="backpropagated twice"):
        out.backward()
        opt.step()


def test_unbatched_input_is_refused():
    model = nn.Linear(3, 1)
    opt = make_opt(model.parameters())  # noqa: F841  (alive while the model runs)
    with pytest.raises(ValueError, match="unbatched"):
        model(torch.randn(3))


def test_parameter_groups_with_different_clip_bounds_are_refused():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = make_opt([{"params": a.parameters()}, {"params": b.parameters(), "max_grad_norm": 3.0}])
    with pytest.raises(ValueError, match="max_grad_norm differs between parameter groups"):
        opt.step()


def test_state_dict_without_ledger_is_refused():
    model = nn.Linear(2, 2)
    state = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    with pytest.raises(ValueError, match="ledger"):
        make_opt(model.parameters()).load_state_dict(state)


def test_register_rule_refuses_duplicates_and_non_modules():
    with pytest.raises(ValueError, match="already registered"):
        dpoptim.register_rule(nn.Linear, dpoptim.Rule())
    with pytest.raises(TypeError, match="nn.Module"):
        dpoptim.register_rule(int, dpoptim.Rule())


def test_subclass_that_overrides_forward_does_not_inherit_the_rule():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(nn.Linear):
        pass

    assert dpoptim.rule_for(Doubled(2, 2)) is None
    assert dpoptim.rule_for(Plain(2, 2)) is dpoptim.rule_for(nn.Linear(2, 2))


def test_parameter_in_two_dp_optimizers_warns():
    model = nn.Linear(2, 2)
    first = make_opt(model.parameters())  # noqa: F841
    with pytest.warns(dpoptim.PrivacyWarning, match="already in another DP optimizer"):
        make_opt(model.parameters())


def test_model_changed_after_the_optimizer_was_built_warns():
    model = nn.Linear(3, 2)
    opt = make_opt(model.parameters())  # noqa: F841
    model(torch.randn(2, 3))
    model.weight = nn.Parameter(torch.zeros(2, 3))
    with pytest.warns(dpoptim.PrivacyWarning, match="'weight' of Linear was replaced"):
        model(torch.randn(2, 3))


def test_training_through_eval_mode_modules_warns_once():
    model = nn.Sequential(nn.Linear(3, 2)).eval()
    opt = make_opt(model.parameters())
    with pytest.warns(dpoptim.PrivacyWarning, match="eval mode"):
        model(torch.randn(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")
        model(torch.randn(2, 3)).sum().backward()


def test_parameter_reused_outside_its_module_after_the_first_step_is_detected():
    model = RawUse()
    opt = make_opt(model.parameters())
    x = torch.randn(5, 4)
    opt.zero_grad()
    model.lin(x).square().sum().backward()  # first step: only the module uses the weight
    opt.step()
    opt.zero_grad()
    model(x).square().sum().backward()  # now also a functional use
    before = model.lin.weight.detach().clone()
    with pytest.raises(UnsupportedLayerError, match="used somewhere dpoptim cannot see"):
        opt.step()
    assert torch.equal(model.lin.weight, before)


def test_another_models_layers_that_change_their_own_state_are_left_alone():
    """While its hooks are process-wide, the optimizer sees every module call, but an
    InstanceNorm tracking statistics or a max_norm Embedding in another model (a baseline
    trained beside it, not privately) is that model's business: only a layer inside the
    trained model is refused for changing its own state."""
    private = nn.Linear(4, 2)
    opt = make_opt(private.parameters())
    norm = nn.InstanceNorm1d(2, track_running_stats=True)
    other = nn.Sequential(nn.Linear(4, 6), nn.Unflatten(1, (2, 3)), norm, nn.Flatten(), nn.Linear(6, 1))
    other(torch.randn(8, 4)).sum().backward()
    nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 1))(torch.randint(0, 10, (8, 2)))
    assert not torch.equal(norm.running_mean, torch.zeros(2))  # that model's own statistics moved
    opt.zero_grad()
    private(torch.randn(8, 4)).sum().backward()
    opt.step()
    assert opt.steps_taken == 1


def test_a_separate_frozen_backbone_that_mixes_examples_is_refused_at_the_first_step():
    """A frozen backbone called as a module of its own, left in training mode: its
    BatchNorm mixes the examples the trained head reads. Before the first checked step the
    hooks see every module in the process, and the head's backward is refused."""
    backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    backbone.requires_grad_(False)
    head = nn.Linear(4, 1)
    opt = make_opt(head.parameters())
    opt.zero_grad()
    head(backbone(torch.randn(6, 4))).sum().backward()
    with pytest.raises(UnsupportedLayerError, match="batch statistics"):
        opt.step()
