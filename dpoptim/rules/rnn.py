"""Recurrent layers: ``nn.RNN`` (tanh, relu), ``nn.LSTM`` (with ``proj_size``), ``nn.GRU``
and their cells ``nn.RNNCell``, ``nn.LSTMCell``, ``nn.GRUCell``.

A recurrent weight is applied once per time step, so for example i it has the gradient
of a Linear layer with one row per step (a weight used T times, :mod:`dpoptim.rules.linear`):

    ``dL/dW_ih = sum_t dz_t x_t^T``,   ``dL/dW_hh = sum_t dz'_t h_{t-1}^T``,
    ``dL/db_ih = sum_t dz_t``,         ``dL/db_hh = sum_t dz'_t``,

where ``dz_t``/``dz'_t`` are the gradients of the input and hidden halves of step t's
gate pre-activations (:mod:`._recurrence`); an LSTM projection adds
``dL/dW_hr = sum_t dh_t m_t^T``. Norms take the ghost or materialised route by cost and
the clipped sum is one matrix product per weight (:mod:`._factored`).

**Whole-sequence modules** run a fused kernel whose gates no hook can see. The rule keeps
the user's module and kernel: it saves the inputs and initial states at forward time, and
at the end of the backward pass replays the recurrence from them with the weights
detached and backpropagates through time by hand, starting from the gradients autograd
delivered to ``output``, ``h_n`` and ``c_n``. Every ``num_layers``, ``bidirectional``,
``batch_first``, ``bias``, ``proj_size``, given or default initial states, and
``PackedSequence`` inputs (the example is the sequence, in the order the batch had before
packing) are exact.

The back-propagation through time also yields the gradients of the input sequence and the
initial states, which is all the fused kernel's backward would add besides the weight
gradients. So after the first step (where autograd's backward runs too and the two are
compared), the rule stands in for that backward (``Rule.inputs``): the engine routes the
outputs through one autograd node that returns these gradients, and the kernel's backward
does not run. Cost: about one more forward of the layer, its weight-free backward
replacing the kernel's.

Dropout between stacked layers (``dropout > 0`` in training) draws its masks inside the
kernel. PyTorch's own implementation (CPU, and CUDA without cuDNN) draws them with ordinary
dropout calls on each layer's output, one after the other, from the default generator:
the rule keeps the generator's state from before the forward and draws the same masks
again, in the same order and shapes (the time-major output, or the packed data of a
``PackedSequence``). cuDNN draws them from a dropout state of its own that nothing
outside can replay, so on CUDA such a module's forward runs with cuDNN off (its other
layers keep cuDNN). That is slower than cuDNN; single-layer modules with ``nn.Dropout``
between them are the same model and keep cuDNN.

**Cells** are called by the user, step by step. Each call is one use; a cell called T
times in one forward pass shares its weights across T uses, which the engine sums per
example before the norm (cross terms included). One use needs no replay beyond the
cell's own gate values, recomputed from its saved input and state.

Unbatched inputs (no batch dimension) are refused: the batch dimension is what tells one
example from another.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .. import _torch
from ..nested import map_tensors
from ..registry import register_rule
from ..verify import autograd_sum
from ._common import common_dtype, rng_replayed, rng_state
from ._factored import Factored, FactoredRule, bias_block, weight_block
from ._recurrence import LayerWeights, Recurrence, replay_stack

__all__ = ["RecurrentRule", "CellRule"]


def _detach(x):
    return map_tensors(torch.Tensor.detach, x)


def _as_list(output) -> list:
    return list(output) if isinstance(output, tuple) else [output]


def _unbatched(module, shape) -> ValueError:
    return ValueError(
        f"{type(module).__name__} got an unbatched input of shape {tuple(shape)}: per-example "
        "clipping needs a batch dimension to tell examples apart. Add one with x.unsqueeze("
        f"{0 if getattr(module, 'batch_first', True) else 1}) (and to the initial state)."
    )


def _consumes(later: torch.Tensor, earlier: torch.Tensor, depth: int = 3) -> bool:
    """Whether autograd computed ``later`` from the tensor ``earlier`` within ``depth`` ops."""
    if later.grad_fn is None or earlier.grad_fn is None:
        return False
    target = (earlier.grad_fn, earlier.output_nr)
    frontier = [later.grad_fn]
    for _ in range(depth):
        edges = [edge for node in frontier for edge in node.next_functions if edge[0] is not None]
        if any(fn is target[0] and nr == target[1] for fn, nr in edges):
            return True
        frontier = [fn for fn, _ in edges]
    return False


def _suffixes(module) -> dict:
    """``(layer, direction) -> "_l{layer}"`` or ``"_l{layer}_reverse"``, as the parameters are named."""
    directions = 2 if module.bidirectional else 1
    return {(layer, d): f"_l{layer}" + ("_reverse" if d else "")
            for layer in range(module.num_layers) for d in range(directions)}


def _pack_like(x: PackedSequence, padded: torch.Tensor) -> torch.Tensor:
    """The packed data of ``padded`` (time-major ``[T, n, .]``, examples in the user's
    order) laid out exactly as ``x.data``."""
    n = int(x.batch_sizes[0]) if len(x.batch_sizes) else 0
    lengths = (x.batch_sizes.unsqueeze(0) > torch.arange(n).unsqueeze(1)).sum(1)  # of the sorted sequences
    if x.sorted_indices is not None:
        padded = padded.index_select(1, x.sorted_indices.to(padded.device))
    return pack_padded_sequence(padded, lengths, enforce_sorted=True).data


def _bound(args, kwargs, index, name):
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


# ---------------------------------------------------------------------------- whole sequences
@register_rule(nn.RNN)
@register_rule(nn.LSTM)
@register_rule(nn.GRU)
class RecurrentRule(FactoredRule):
    """``nn.RNN``, ``nn.LSTM``, ``nn.GRU``: replay and back-propagation through time."""

    reads_weights = True

    @staticmethod
    def _drops(module) -> bool:
        return module.training and module.dropout > 0 and module.num_layers > 1

    def check(self, module):
        if self._drops(module):
            self.call_state(module)["rng_before"] = rng_state(module.weight_ih_l0.device)

    def forward_context(self, module):
        # cuDNN draws the masks between stacked layers from a dropout state of its own that
        # nothing outside can replay; PyTorch's own CUDA implementation draws them as on CPU.
        if self._drops(module) and module.weight_ih_l0.device.type == "cuda":
            return _torch.cudnn_disabled()
        return None

    @staticmethod
    def _input_tensors(module, args, kwargs):
        """``(data, h0, c0)`` of a call, each a tensor or None."""
        x = _bound(args, kwargs, 0, "input")
        hx = _bound(args, kwargs, 1, "hx")
        h0, c0 = (hx if isinstance(hx, tuple) else (hx, None)) if hx is not None else (None, None)
        return (x.data if isinstance(x, PackedSequence) else x), h0, c0

    def save(self, module, args, kwargs, output):
        x = _bound(args, kwargs, 0, "input")
        hx = _bound(args, kwargs, 1, "hx")
        if not isinstance(x, PackedSequence) and x.dim() != 3:
            raise _unbatched(module, x.shape)
        out = output[0]
        state = self.call_state(module)["rng_before"] if self._drops(module) else None
        needs = tuple(t is not None and t.requires_grad for t in self._input_tensors(module, args, kwargs))
        return {"x": _detach(x), "hx": _detach(hx), "state": state, "needs": needs,
                "out": (out.data if isinstance(out, PackedSequence) else out).detach()}

    def outputs(self, module, output):
        out, hidden = output
        data = out.data if isinstance(out, PackedSequence) else out
        return [data, *(hidden if isinstance(hidden, tuple) else (hidden,))]

    def with_outputs(self, module, output, tensors):
        out, hidden = output
        out = out._replace(data=tensors[0]) if isinstance(out, PackedSequence) else tensors[0]
        return out, (tuple(tensors[1:]) if isinstance(hidden, tuple) else tensors[1])

    # The replay runs back-propagation through time anyway, so it also returns the
    # gradients of the input sequence and the initial states: the engine then skips the
    # fused kernel's own backward (Rule.inputs).
    def inputs(self, module, args, kwargs):
        return [t for t in self._input_tensors(module, args, kwargs) if t is not None and t.requires_grad]

    def input_gradients(self, use):
        need_x, need_h, need_c = use.saved["needs"]
        _, (dx, dh0, dc0) = self._replay(use, input_grads=True)
        x, hx = use.saved["x"], use.saved["hx"]
        h0, c0 = (hx if isinstance(hx, tuple) else (hx, None)) if hx is not None else (None, None)
        grads = []
        if need_x:
            if isinstance(x, PackedSequence):
                dx = _pack_like(x, dx)
            elif use.module.batch_first:
                dx = dx.transpose(0, 1)
            grads.append(dx.to(x.data.dtype))
        if need_h:
            grads.append(dh0.to(h0.dtype))
        if need_c:
            grads.append(dc0.to(c0.dtype))
        return grads

    def factors(self, use):
        module = use.module
        replayed, _ = self._replay(use)
        suffixes = _suffixes(module)
        factors = {}
        for key, (x_in, h_prev, m, dgi, dgh, dproj, rows) in replayed.items():
            # Time-major rows (batch_dim=1). For RNN and LSTM dgh is dgi, one object, so
            # the norms compute its Gram matrix once and the clipped sums share one product.
            joint = (None, None) if rows is None else ((rows, 0), (rows, x_in.shape[-1]))
            for kind, blocks in (
                ("weight_ih", [weight_block(x_in, dgi, batch_dim=1, joint=joint[0])]),
                ("weight_hh", [weight_block(h_prev, dgh, batch_dim=1, joint=joint[1])]),
                ("bias_ih", [bias_block(dgi, batch_dim=1)]),
                ("bias_hh", [bias_block(dgh, batch_dim=1)]),
                ("weight_hr", [weight_block(m, dproj, batch_dim=1)] if dproj is not None else None),
            ):
                p = getattr(module, kind + suffixes[key], None)
                if blocks is not None and p is not None:
                    factors[kind + suffixes[key]] = Factored(blocks, p.shape)
        return factors

    def _replay(self, use, input_grads=False):
        """:func:`replay_stack` for this use, once: ``(per layer, input gradients or None)``.
        A stand-in backward (:meth:`input_gradients`) leaves it in ``use.cache`` for the
        norms and clipped sums."""
        done = use.cache.get("replayed")
        if done is not None and (done[1] is not None or not input_grads):
            return done
        module = use.module
        x, hx, out, state = (use.saved[k] for k in ("x", "hx", "out", "state"))
        lstm = module.mode == "LSTM"
        directions = 2 if module.bidirectional else 1
        H_out = module.proj_size if module.proj_size > 0 else module.hidden_size
        dtype = common_dtype(x.data, module.weight_ih_l0)
        grad_out = use.grad_outputs[0]
        if grad_out is None:
            grad_out = torch.zeros_like(out)

        # Time-major and padded, examples in the order the user's batch had.
        if isinstance(x, PackedSequence):
            inputs, lengths = pad_packed_sequence(x)
            output, _ = pad_packed_sequence(x._replace(data=out))
            d_output, _ = pad_packed_sequence(x._replace(data=grad_out))
        else:
            time_major = (lambda t: t.transpose(0, 1)) if module.batch_first else (lambda t: t)
            inputs, output, d_output, lengths = time_major(x), time_major(out), time_major(grad_out), None
        inputs, output, d_output = inputs.to(dtype), output.to(dtype), d_output.to(dtype)
        n = inputs.shape[1]

        states = module.num_layers * directions
        h0, c0 = (hx if lstm else (hx, None)) if hx is not None else (None, None)
        h0 = inputs.new_zeros(states, n, H_out) if h0 is None else h0.to(dtype)
        if lstm:
            c0 = inputs.new_zeros(states, n, module.hidden_size) if c0 is None else c0.to(dtype)

        def grad_or_zeros(index, like):
            g = use.grad_outputs[index] if index < len(use.grad_outputs) else None
            return torch.zeros_like(like) if g is None else g.to(dtype)

        dh_n = grad_or_zeros(1, h0)
        dc_n = grad_or_zeros(2, c0) if lstm else None

        suffixes = _suffixes(module)
        weights = [[LayerWeights(*(self._weight(module, kind + suffixes[layer, d], dtype)
                                   for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")))
                    for d in range(directions)] for layer in range(module.num_layers)]

        masks = None if state is None else self._masks(module, x, out, state, dtype)
        done = use.cache["replayed"] = replay_stack(
            module.mode, inputs, h0, c0, weights, module.num_layers, module.bidirectional,
            lengths, output, d_output, dh_n, dc_n, masks, input_grads=input_grads,
            input_dx=use.saved["needs"][0])
        return done

    @staticmethod
    def _masks(module, x, out, state, dtype):
        """The dropout masks the forward drew between layers, time-major and padded: the
        CPU kernel drops each layer's output (time-major, or the packed data) in turn."""
        masks = []
        with rng_replayed(out.device, state):
            for _ in range(module.num_layers - 1):
                if isinstance(x, PackedSequence):
                    mask = F.dropout(torch.ones(out.shape, dtype=out.dtype, device=out.device), module.dropout)
                    mask, _ = pad_packed_sequence(x._replace(data=mask))
                else:
                    T, n = (out.shape[1], out.shape[0]) if module.batch_first else out.shape[:2]
                    mask = F.dropout(torch.ones(T, n, out.shape[-1], dtype=out.dtype, device=out.device),
                                     module.dropout)
                masks.append(mask.to(dtype))
        return masks

    @staticmethod
    def _weight(module, name, dtype):
        p = getattr(module, name, None)
        return None if p is None else p.detach().to(dtype)


# ---------------------------------------------------------------------------- cells
_CELL_MODES = {nn.LSTMCell: "LSTM", nn.GRUCell: "GRU"}


@register_rule(nn.RNNCell)
@register_rule(nn.LSTMCell)
@register_rule(nn.GRUCell)
class CellRule(FactoredRule):
    """``nn.RNNCell``, ``nn.LSTMCell``, ``nn.GRUCell``: one step, one use."""

    reads_weights = True

    detach_parameters = True  # the forward reads self.weight_ih, ... at call time

    @staticmethod
    def _mode(module):
        for cls, mode in _CELL_MODES.items():
            if isinstance(module, cls):
                return mode
        return "RNN_TANH" if module.nonlinearity == "tanh" else "RNN_RELU"

    def save(self, module, args, kwargs, output):
        x = _bound(args, kwargs, 0, "input")
        if x.dim() != 2:
            raise _unbatched(module, x.shape)
        # LSTMCell returns (h', c'). Where autograd records the cell op by op (CPU), h' is
        # computed from the c' tensor, so the gradient a hook sees on c' already holds the
        # path through h'; a fused kernel (CUDA) returns both from one node and it does not.
        dc_is_total = isinstance(output, tuple) and _consumes(output[0], output[1])
        return x.detach(), _detach(_bound(args, kwargs, 1, "hx")), dc_is_total

    def route(self, use):
        """Whether ``c'`` carried the total gradient (read off autograd's graph at forward
        time), with the kernel's device and dtype: checked against autograd once each."""
        x, _, dc_is_total = use.saved
        return (self._mode(use.module), dc_is_total, x.device.type, x.dtype)

    def reference(self, use, names):
        x, hx, _ = use.saved
        module = use.module
        grads = list(use.grad_outputs) + [None]

        def forward():
            out = _as_list(type(module).forward(module, x, hx))
            if len(out) == 2 and grads[0] is not None and grads[1] is not None:
                # Where autograd's own graph computes h' from c', the gradient the hook saw
                # on c' holds the path through h' too: take it out, so each path counts once.
                through = torch.autograd.grad(out[0], out[1], grads[0], retain_graph=True, allow_unused=True)[0]
                if through is not None:
                    grads[1] = grads[1] - through
            return out

        return autograd_sum(module, names, forward, grads)

    def factors(self, use):
        module = use.module
        mode = self._mode(module)
        x, hx, dc_is_total = use.saved
        dtype = common_dtype(x, module.weight_ih)
        x = x.to(dtype)
        n, H = x.shape[0], module.hidden_size
        h, c = (hx if mode == "LSTM" else (hx, None)) if hx is not None else (None, None)
        h = x.new_zeros(n, H) if h is None else h.to(dtype)
        if mode == "LSTM":
            c = x.new_zeros(n, H) if c is None else c.to(dtype)
        weights = LayerWeights(*(None if p is None else p.detach().to(dtype)
                                 for p in (module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh)))
        step = Recurrence(mode, x.unsqueeze(0), h, c, weights)

        grads = [None if g is None else g.to(dtype) for g in use.grad_outputs]
        dh = grads[0] if grads[0] is not None else h.new_zeros(n, H)
        dc = None
        if mode == "LSTM":
            dc = grads[1] if len(grads) > 1 and grads[1] is not None else h.new_zeros(n, H)
        dgi, dgh, _ = step.backward(dh.unsqueeze(0), torch.zeros_like(dh), dc, dc_is_total)
        factors = {  # one time step, time-major: [1, n, .]
            "weight_ih": Factored([weight_block(x.unsqueeze(0), dgi, batch_dim=1)], module.weight_ih.shape),
            "weight_hh": Factored([weight_block(h.unsqueeze(0), dgh, batch_dim=1)], module.weight_hh.shape),
        }
        if module.bias:
            factors["bias_ih"] = Factored([bias_block(dgi, batch_dim=1)], module.bias_ih.shape)
            factors["bias_hh"] = Factored([bias_block(dgh, batch_dim=1)], module.bias_hh.shape)
        return factors
