"""The custom-rule example of docs/rules.md: the same code, checked against the oracle."""

import math
import pathlib
import re
import weakref

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import dpoptim
from oracle import check_rule_case, mse

# --- example from docs/rules.md ---
class Scale(nn.Module):
    """A learnable scale per feature: y = x * weight, over any leading dimensions."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return x * self.weight


@dpoptim.register_rule(Scale)
class ScaleRule(dpoptim.Rule):
    # forward() reads self.weight when it runs, so the engine may hand it a detached alias
    # and let autograd skip the weight gradient this rule computes anyway.
    detach_parameters = True

    def save(self, module, args, kwargs, output):
        x = args[0]
        if x.dim() < 2:
            raise ValueError(f"Scale needs a batch dimension in front, got shape {tuple(x.shape)}")
        return x.detach()

    def per_example(self, use, names):
        x, b = use.saved, use.grad_outputs[0]  # b = dL/dy, the same shape as x
        n, features = x.shape[0], x.shape[-1]
        positions = math.prod(x.shape[1:-1])  # tokens, pixels...: 1 for a plain [n, features]
        wide = torch.promote_types(x.dtype, torch.float32)  # accumulate in float32 or wider
        # g_i = sum over the positions of example i of x * b  ->  [n, features]
        g = (x.to(wide) * b.to(wide)).reshape(n, positions, features).sum(1)
        return {"weight": g}
# --- end of example ---


@given(
    n=st.integers(0, 4),
    lead=st.lists(st.integers(1, 3), max_size=2),
    features=st.integers(1, 5),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
)
def test_scale_rule_matches_oracle(n, lead, features, reduction, clip):
    g = torch.Generator().manual_seed(n + 7 * features)
    x = torch.randn(n, *lead, features, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    width = features * (1 if not lead else torch.Size(lead).numel())

    def make():
        scale = Scale(features).double()
        with torch.no_grad():
            scale.weight.normal_()
        return nn.Sequential(nn.Linear(features, features).double(), scale, nn.Tanh(), nn.Flatten(),
                             nn.Linear(width, 2).double())

    check_rule_case(make, (x,), y, lambda m, x: m(x), mse, max_grad_norm=clip, reduction=reduction)


def test_docs_show_this_code():
    """docs/rules.md must show exactly the example tested here."""
    here = pathlib.Path(__file__).read_text()
    tested = here.split("# --- example from docs/rules.md ---\n")[1].split("# --- end of example ---")[0]
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "rules.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", docs, flags=re.S)
    # The docs add the imports this module has at its top.
    code = ["\n".join(line for line in b.splitlines() if not line.startswith(("import ", "from "))) for b in blocks]
    assert any(tested.strip() in c for c in code), "docs/rules.md and tests/test_custom_rule.py differ"


class Doubler(nn.Module):
    """y = 2 x w; raises when asked to, to show the context is left all the same."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x, fail=False):
        if fail:
            raise RuntimeError("asked to fail")
        return 2 * x * self.weight


class DoublerRule(dpoptim.Rule):
    def __init__(self, events):
        self.events = events

    def forward_context(self, module):
        events = self.events

        class Context:
            def __enter__(self):
                events.append("enter")

            def __exit__(self, *exc):
                events.append("exit")

        return Context()

    def save(self, module, args, kwargs, output):
        self.events.append("save")
        return args[0].detach()

    def per_example(self, use, names):
        return {"weight": 2 * use.saved * use.grad_outputs[0]}


def test_forward_context_is_entered_around_each_forward_and_left_on_error():
    events = []
    dpoptim.register_rule(Doubler, DoublerRule(events))
    model = Doubler()
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.5)
    model(torch.randn(2, 3)).sum().backward()
    assert events == ["enter", "save", "exit"]
    events.clear()
    with pytest.raises(RuntimeError, match="asked to fail"):
        model(torch.randn(2, 3), fail=True)
    assert events == ["enter", "exit"]
    events.clear()
    with torch.no_grad():  # nothing recorded without gradients
        model(torch.randn(2, 3))
    assert events == []
    del opt


class Keeper(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.weight


class KeeperRule(dpoptim.Rule):
    """Keeps its per-example gradients in the use's cache, and a weak reference to them."""

    def __init__(self):
        self.refs = []

    def save(self, module, args, kwargs, output):
        return args[0].detach()

    def per_example(self, use, names):
        g = use.cache["g"] = use.saved * use.grad_outputs[0]
        self.refs.append(weakref.ref(g))
        return {"weight": g}


def test_rule_cache_is_released_at_the_end_of_each_backward():
    """The graph (and with it the call's record) lives as long as the loss does; what the
    rule cached must not: its tensors are as large as the per-example gradients."""
    rule = KeeperRule()
    dpoptim.register_rule(Keeper, rule)
    model = Keeper()
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.5)
    for step in ("first (checked) step", "later step"):
        loss = model(torch.randn(4, 3)).sum()
        loss.backward()  # the loss, and so the graph, is still alive
        assert rule.refs and all(ref() is None for ref in rule.refs), step
        opt.step()
        opt.zero_grad()
        rule.refs.clear()


def test_docs_list_every_method_of_the_rule_contract():
    """docs/rules.md names every overridable member of the three parts of the contract."""
    import pathlib

    from dpoptim.registry import Acceleration, Capture, RuleMath, Verification

    text = (pathlib.Path(__file__).parent.parent / "docs" / "rules.md").read_text()
    for part in (RuleMath, Capture, Acceleration, Verification):
        for name in vars(part):
            if not name.startswith("_"):
                assert f"`{name}" in text, f"docs/rules.md does not list {part.__name__}.{name}"


def test_rules_keep_no_state_of_a_call_on_themselves():
    """Rules are shared by every module of their type: a call's state (the generator state
    for dropout replays, the bare rule's open call) lives in Rule.call_state, not on the rule."""
    from dpoptim.registry import resolve_rule

    lstm = nn.LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True)
    attn = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.w

    scale = Scale()
    params = [*lstm.parameters(), *attn.parameters(), *scale.parameters()]
    opt = dpoptim.DPSGD(params, lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.5)
    x = torch.randn(2, 5, 3)
    for _ in range(2):
        opt.zero_grad()
        h, _ = lstm(x)
        y, _ = attn(h, h, h)
        scale(y).sum().backward()
        opt.step()
    for module in (lstm, attn, scale):
        assert not vars(resolve_rule(module)), type(resolve_rule(module)).__name__
