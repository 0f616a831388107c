"""The recurrences of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``, replayed and backpropagated by hand.

PyTorch runs these layers as fused kernels (cuDNN on CUDA, oneDNN or an ATen loop on
CPU): the per-step gate values never reach a module hook. The per-example gradients need
exactly those. With ``gi_t = W_ih x_t + b_ih`` and ``gh_t = W_hh h_{t-1} + b_hh`` the
input and hidden halves of step t's pre-activations,

    ``dL/dW_ih = sum_t dgi_t x_t^T``,   ``dL/dW_hh = sum_t dgh_t h_{t-1}^T``,
    ``dL/db_ih = sum_t dgi_t``,         ``dL/db_hh = sum_t dgh_t``

for each example (``dgi = dgh`` for RNN and LSTM; for GRU they differ in the candidate
gate, whose hidden half is multiplied by the reset gate). With an LSTM projection
``h_t = W_hr m_t``: ``dL/dW_hr = sum_t dh_t m_t^T``.

:class:`Recurrence` recomputes one layer-direction's states from the inputs and initial
states the module saw, with its weights detached, and runs back-propagation through time
(Werbos 1990, "Backpropagation through time: what it does and how to do it") from the
gradients autograd delivered to the layer's outputs. This is one layer's recurrence, not
a second backward over the model.

Cost is kept close to one forward and one weight-free backward of the layer:

* When the layer's output sequence is known (the top layer of the module), the previous
  hidden states are read from it, so every gate is computed in a few bulk operations;
  only the LSTM cell state needs a loop, of two element-wise operations a step.
  Otherwise the forward is replayed step by step (one matrix product a step).
* The backward is a linear recurrence in ``dh``: everything it multiplies by is
  computed in bulk before the loop ("coefficients"), leaving one matrix product and a
  few element-wise operations per step.

Gate equations (PyTorch's documentation; ``s`` is the logistic sigmoid):

* RNN: ``h = tanh(gi + gh)`` or ``relu(gi + gh)``.
* LSTM: ``i, f, g, o = s, s, tanh, s`` of the quarters of ``gi + gh``; ``c = f c' + i g``;
  ``m = o tanh(c)``; ``h = m`` or ``W_hr m``.
* GRU: ``r, u = s(gi_r + gh_r), s(gi_z + gh_z)``; ``n = tanh(gi_n + r gh_n)``;
  ``h = (1 - u) n + u h'``.

Sequences of different lengths are replayed padded to T steps. Where a sequence has
ended (``t >= length``) its state is frozen, ``h_t = h_{t-1}``, which is what the packed
kernel computes: its coefficients are zero there and the state's gradient passes through.

Shapes: time-major ``[T, n, .]`` throughout; ``G`` is the gate width (H, 3H or 4H).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["LayerWeights", "Recurrence", "replay_stack"]


class LayerWeights:
    """The (detached) weights of one layer and direction; absent ones are None."""

    __slots__ = ("w_ih", "w_hh", "b_ih", "b_hh", "w_hr")

    def __init__(self, w_ih, w_hh, b_ih=None, b_hh=None, w_hr=None):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = w_ih, w_hh, b_ih, b_hh, w_hr


_sigmoid_grad = torch.ops.aten.sigmoid_backward  # (x, s) -> x s (1 - s)
_tanh_grad = torch.ops.aten.tanh_backward  # (x, t) -> x (1 - t^2)


def _tanh(x: torch.Tensor) -> torch.Tensor:
    """``tanh(x) = 2 sigmoid(2x) - 1``: several times faster than ``torch.tanh`` on CPU."""
    return torch.sigmoid(2 * x).mul_(2).sub_(1)


def _step(mode, gi, gh, h, c):
    """One step of the recurrence from ``gi``, ``gh`` (``[n, G]``) and the previous
    states; returns ``(m, c_new)`` (``m`` before any LSTM projection)."""
    if mode == "RNN_TANH":
        return _tanh(gi + gh), None
    if mode == "RNN_RELU":
        return torch.relu(gi + gh), None
    if mode == "LSTM":
        z = gi + gh
        H = z.shape[-1] // 4
        s = torch.sigmoid(z)
        c = torch.addcmul(s[..., H:2 * H] * c, s[..., :H], _tanh(z[..., 2 * H:3 * H]))
        return s[..., 3 * H:] * _tanh(c), c
    H = gi.shape[-1] // 3  # GRU
    s = torch.sigmoid(gi[..., :2 * H] + gh[..., :2 * H])
    n = _tanh(torch.addcmul(gi[..., 2 * H:], s[..., :H], gh[..., 2 * H:]))
    return torch.addcmul(n, s[..., H:], h - n), None


class Recurrence:
    """One layer in one direction: forward replay, then :meth:`backward`.

    ``x: [T, n, d]``; ``h0``, ``c0``: ``[n, .]`` (``c0`` only for LSTM); ``active``:
    ``[T, n, 1]`` booleans (None when every sequence runs all T steps); ``out``: the
    layer's output sequence ``[T, n, H_out]`` if known (the module returned it),
    which saves the step-by-step replay.
    """

    def __init__(self, mode, x, h0, c0, weights: LayerWeights, active=None, reverse=False, out=None):
        self.mode, self.weights, self.active = mode, weights, active
        w = weights
        T = x.shape[0]
        self.order = range(T - 1, -1, -1) if reverse else range(T)
        c_prev = c = None
        if out is None:  # replay step by step
            gi = F.linear(x, w.w_ih, w.b_ih)
            h_prev, out, gh, c_prev, c = self._replay(gi, h0, c0)
            pre = (gi, gh) if mode == "GRU" else gi + gh
            self.rows = None
        else:
            self.rows = self._rows(x, out, h0, reverse)  # [x_t | h_{t-1}]: what the weights multiply
            h_prev = self.rows[..., x.shape[-1]:]
            if mode == "GRU":
                pre = F.linear(x, w.w_ih, w.b_ih), F.linear(h_prev, w.w_hh, w.b_hh)
            elif mode == "LSTM":  # only gi + gh is needed: one product
                bias = None if w.b_ih is None else w.b_ih + w.b_hh
                pre = F.linear(self.rows, torch.cat([w.w_ih, w.w_hh], dim=1), bias)
            else:  # RNN: the coefficients need only the outputs
                pre = None
        self.out, self.h_prev = out, h_prev
        self._coefficients(pre, h_prev, c0, c_prev, c)

    # -------------------------------------------------------------------- forward
    def _replay(self, gi, h, c):
        w, active = self.weights, self.active
        T = gi.shape[0]
        h_prev, out, gh = [None] * T, [None] * T, [None] * T
        c_prev, c_new = ([None] * T, [None] * T) if c is not None else (None, None)
        for t in self.order:
            gh[t] = F.linear(h, w.w_hh, w.b_hh)
            m, c_t = _step(self.mode, gi[t], gh[t], h, c)
            h_t = m if w.w_hr is None else F.linear(m, w.w_hr)
            if active is not None:  # a finished sequence keeps its state
                h_t = torch.where(active[t], h_t, h)
                if c is not None:
                    c_t = torch.where(active[t], c_t, c)
            h_prev[t], out[t] = h, h_t
            if c is not None:
                c_prev[t], c_new[t] = c, c_t
            h, c = h_t, c_t
        stack = torch.stack
        if c is None:
            return stack(h_prev), stack(out), stack(gh), None, None
        return stack(h_prev), stack(out), stack(gh), stack(c_prev), stack(c_new)

    def _rows(self, x, out, h0, reverse):
        """``[x_t | h_{t-1}]``, the previous states read off the output sequence."""
        T, d = x.shape[0], x.shape[-1]
        rows = x.new_empty(*x.shape[:-1], d + out.shape[-1])
        rows[..., :d] = x
        h_prev = rows[..., d:]
        if reverse:
            h_prev[:T - 1] = out[1:]
            h_prev[T - 1] = h0
            if self.active is not None:
                # A sequence of length l starts its reverse pass at step l - 1, from h0.
                starts = torch.cat([self.active[1:], torch.zeros_like(self.active[:1])])
                h_prev.copy_(torch.where(starts, h_prev, h0))
        else:
            h_prev[1:] = out[:-1]
            h_prev[0] = h0
        return rows

    # -------------------------------------------------------------------- coefficients
    def _coefficients(self, pre, h_prev, c0, c_prev, c):
        """What the backward multiplies by, in bulk. ``pre``: ``gi + gh`` (LSTM), ``(gi, gh)``
        (GRU) or None (RNN). ``sigma'(z) = s (1 - s)`` and ``tanh'(z) = 1 - t^2`` are
        applied with autograd's own fused kernels (one pass each)."""
        mode, keep = self.mode, self.active
        self.keep = None if keep is None else keep.to(h_prev.dtype)
        self.m = None
        if mode in ("RNN_TANH", "RNN_RELU"):
            m = self.out
            K = _tanh_grad(torch.ones_like(m), m) if mode == "RNN_TANH" else (m > 0).to(m.dtype)
            self.K = K if keep is None else K * self.keep
        elif mode == "LSTM":
            H = pre.shape[-1] // 4
            pre[..., 2 * H:3 * H] *= 2  # pre is ours: tanh(z_g) = 2 sigmoid(2 z_g) - 1
            s = torch.sigmoid(pre)
            i, f, o = s[..., :H], s[..., H:2 * H], s[..., 3 * H:]
            g = s[..., 2 * H:3 * H].mul(2).sub_(1)
            if c is None:  # the states were read off the output: run the cell-state loop
                c_prev, c = self._cell_states(i, f, g, c0)
            tc = _tanh(c)
            if self.weights.w_hr is not None:
                self.m = o * tc
            A = _tanh_grad(o, tc)  # dc += dm A
            K3 = s.new_empty(*s.shape[:2], 3, H)  # dz_{i,f,g} = dc K3
            _sigmoid_grad.grad_input(g, i, grad_input=K3[:, :, 0])
            _sigmoid_grad.grad_input(c_prev, f, grad_input=K3[:, :, 1])
            _tanh_grad.grad_input(i, g, grad_input=K3[:, :, 2])
            Ko = _sigmoid_grad(tc, o)  # dz_o = dm Ko
            if keep is not None:
                A, K3, Ko = A * self.keep, K3 * self.keep.unsqueeze(2), Ko * self.keep
                f = torch.where(keep, f, 1.0)
            self.A, self.K3, self.Ko, self.f = A, K3, Ko, f
        else:  # GRU
            gi, gh = pre
            H = gi.shape[-1] // 3
            s = torch.sigmoid(gi[..., :2 * H] + gh[..., :2 * H])
            r, u = s[..., :H], s[..., H:]
            gh_n = gh[..., 2 * H:]
            n = _tanh(torch.addcmul(gi[..., 2 * H:], r, gh_n))
            Kgi = s.new_empty(*s.shape[:2], 3, H)  # dgi = dm Kgi
            Kn = _tanh_grad.grad_input(1 - u, n, grad_input=Kgi[:, :, 2])  # n's pre-activation
            _sigmoid_grad.grad_input(Kn * gh_n, r, grad_input=Kgi[:, :, 0])
            _sigmoid_grad.grad_input(h_prev - n, u, grad_input=Kgi[:, :, 1])
            if keep is not None:
                Kgi = Kgi * self.keep.unsqueeze(2)
                u = torch.where(keep, u, 1.0)
            Kgh = Kgi.clone()  # dgh = dm Kgh: the candidate's hidden half sits behind r
            Kgh[:, :, 2] *= r
            self.Kgi, self.Kgh, self.u = Kgi, Kgh, u

    def _cell_states(self, i, f, g, c):
        """``c_t = f_t c_{t-1} + i_t g_t`` in order, written into one buffer ``C`` of T + 1
        states: ``(c_prev, c_new)`` are two views of it, no copies."""
        T = i.shape[0]
        ig = i * g
        C = ig.new_empty(T + 1, *ig.shape[1:])
        reverse = self.order[0] != 0 if T else False
        first = T if reverse else 0
        C[first] = c
        for t in self.order:
            src, dst = (t + 1, t) if reverse else (t, t + 1)
            if self.active is None:
                torch.addcmul(ig[t], f[t], C[src], out=C[dst])
            else:
                torch.where(self.active[t], torch.addcmul(ig[t], f[t], C[src]), C[src], out=C[dst])
        return (C[1:], C[:-1]) if reverse else (C[:-1], C[1:])

    # -------------------------------------------------------------------- backward
    def backward(self, d_out, dh_last, dc_last=None, dc_is_total=False, initial=False):
        """Back-propagation through time from ``d_out: [T, n, H_out]`` (gradient of the
        output sequence) and the final states' gradients. ``dc_is_total``: ``dc_last``
        already includes the path through the last ``h`` (LSTM cells recorded op by op).
        ``initial``: also leave the initial states' gradients in ``self.dh0``, ``self.dc0``.

        Returns time-major ``(dgi, dgh, dproj)``; ``dproj`` (gradient of the LSTM
        projection's output) is None without a projection."""
        order = list(reversed(self.order))  # backward in time
        steps = list(zip(order, order[1:] + [None]))  # each step and the one it hands its gradient to
        if self.mode in ("RNN_TANH", "RNN_RELU"):
            return self._backward_rnn(d_out, dh_last, steps, initial)
        if self.mode == "LSTM":
            return self._backward_lstm(d_out, dh_last, dc_last, dc_is_total, steps, initial)
        return self._backward_gru(d_out, dh_last, steps, initial)

    def _backward_rnn(self, d_out, dh, steps, initial):
        W, keep = self.weights.w_hh, self.keep
        pass_through = None if keep is None else 1 - keep
        last = steps[0][0]  # the last time step, where the backward starts
        dz = torch.empty_like(self.K)
        dh_t = dh + d_out[last]  # gradient of h_t
        for t, t_next in steps:
            torch.mul(dh_t, self.K[t], out=dz[t])
            if t_next is None:
                if initial:
                    self.dh0 = self._initial(dz[t].mm(W), dh_t, t)
                break
            dh_next = torch.addmm(d_out[t_next], dz[t], W)
            if pass_through is not None:
                dh_next = torch.addcmul(dh_next, dh_t, pass_through[t])
            dh_t = dh_next
        return dz, dz, None

    def _backward_lstm(self, d_out, dh, dc_last, dc_is_total, steps, initial):
        w, keep = self.weights, self.keep
        T, n, W = d_out.shape[0], d_out.shape[1], w.w_hh
        pass_through = None if keep is None else 1 - keep
        dproj = None
        last = steps[0][0]  # the last time step, where the backward starts
        H = self.A.shape[-1]
        dz = self.A.new_empty(T, n, 4, H)
        dc = dc_last
        if w.w_hr is not None:
            dproj = torch.empty_like(d_out)
        dh_t = dh + d_out[last]
        for t, t_next in steps:
            dm = dh_t
            if dproj is not None:
                dproj[t] = dh_t if keep is None else dh_t * keep[t]
                dm = dproj[t].mm(w.w_hr)
            if not (dc_is_total and t == last):  # a total dc already holds this path
                dc = torch.addcmul(dc, dm, self.A[t])
            torch.mul(dc.unsqueeze(1), self.K3[t], out=dz[t, :, :3])
            torch.mul(dm, self.Ko[t], out=dz[t, :, 3])
            if t_next is None:
                if initial:
                    self.dh0 = self._initial(dz[t].view(n, 4 * H).mm(W), dh_t, t)
                    self.dc0 = dc * self.f[t]
                break
            dc = dc * self.f[t]
            dh_next = torch.addmm(d_out[t_next], dz[t].view(n, 4 * H), W)
            if pass_through is not None:
                dh_next = torch.addcmul(dh_next, dh_t, pass_through[t])
            dh_t = dh_next
        dz = dz.view(T, n, 4 * H)
        return dz, dz, dproj

    def _backward_gru(self, d_out, dh, steps, initial):
        T, n, W = d_out.shape[0], d_out.shape[1], self.weights.w_hh
        last = steps[0][0]  # the last time step, where the backward starts
        H = self.u.shape[-1]
        dm_all = torch.empty_like(d_out)
        dgh = self.u.new_empty(T, n, 3, H)
        dm = torch.add(dh, d_out[last], out=dm_all[last])
        for t, t_next in steps:
            torch.mul(dm.unsqueeze(1), self.Kgh[t], out=dgh[t])
            if t_next is None:
                if initial:  # the frozen state's pass-through is in u (1 where inactive)
                    self.dh0 = torch.addcmul(dgh[t].view(n, 3 * H).mm(W), dm, self.u[t])
                break
            dm_next = torch.addcmul(d_out[t_next], dm, self.u[t], out=dm_all[t_next])
            dm = dm_next.addmm_(dgh[t].view(n, 3 * H), W)
        dgi = (dm_all.unsqueeze(2) * self.Kgi).view(T, n, 3 * H)
        return dgi, dgh.view(T, n, 3 * H), None

    def _initial(self, through_weights, dh_t, t):
        """The initial state's gradient from the first step's: ``dz W_hh``, plus the state
        itself where a sequence had not started yet (a reversed, shorter one)."""
        if self.keep is None:
            return through_weights
        return torch.addcmul(through_weights, dh_t, 1 - self.keep[t])


def replay_stack(mode, x, h0, c0, weights, num_layers, bidirectional, lengths, output, d_output, dh_n, dc_n,
                 masks=None, input_grads=False, input_dx=True):
    """Replay a stacked, possibly bidirectional, recurrent module and backpropagate through it.

    ``x: [T, n, in]`` padded (``lengths: [n]``, or None when every sequence has T steps);
    ``h0``/``c0``: ``[layers * directions, n, .]`` (``c0`` None unless LSTM);
    ``weights[layer][direction]``: :class:`LayerWeights`; ``output``: the module's output
    sequence ``[T, n, directions * H_out]`` (the top layer's); ``d_output`` its gradient;
    ``dh_n``/``dc_n`` the final states' gradients, shaped like ``h0``/``c0``; ``masks``: the
    dropout masks between layers (``masks[l]`` multiplies layer l's output, scaled by
    ``1 / (1 - p)``, before layer l + 1 reads it), time-major, or None.

    Returns ``{(layer, direction): (x_in, h_prev, m, dgi, dgh, dproj, rows)}``, every tensor
    time-major ``[T, n, .]``: the rows and gradients of the per-example weight gradients
    (``m``, ``dproj``: LSTM projection only; ``rows``: ``[x_in | h_prev]`` when the
    replay built it, else None), and with ``input_grads`` the gradients of the module's
    inputs ``(dx, dh0, dc0)`` (``dx`` time-major and padded like ``x``, None without
    ``input_dx``; ``dc0`` None unless LSTM), else None.
    """
    directions = 2 if bidirectional else 1
    replays, inputs = _replay_layers(mode, x, h0, c0, weights, num_layers, directions, lengths, output, masks)
    result = {}
    d_layer_out = d_output
    for layer in reversed(range(num_layers)):
        parts = d_layer_out.chunk(directions, dim=-1)
        d_below = None
        for d, replay in enumerate(replays[layer]):
            k = layer * directions + d
            dgi, dgh, dproj = replay.backward(parts[d], dh_n[k], None if dc_n is None else dc_n[k],
                                              initial=input_grads)
            result[(layer, d)] = (inputs[layer], replay.h_prev, replay.m, dgi, dgh, dproj, replay.rows)
            if layer > 0 or (input_grads and input_dx):
                dx = torch.matmul(dgi, replay.weights.w_ih)
                d_below = dx if d_below is None else d_below + dx
        if layer > 0:
            d_layer_out = d_below if masks is None else d_below * masks[layer - 1]
    if not input_grads:
        return result, None
    initial = [replays[layer][d] for layer in range(num_layers) for d in range(directions)]
    dh0 = torch.stack([r.dh0 for r in initial])
    dc0 = torch.stack([r.dc0 for r in initial]) if c0 is not None else None
    return result, (d_below, dh0, dc0)


def _replay_layers(mode, x, h0, c0, weights, num_layers, directions, lengths, output, masks):
    """The forward half of :func:`replay_stack`: a :class:`Recurrence` per layer and
    direction (``replays[layer][direction]``) and each layer's input sequence."""
    T = x.shape[0]
    active = None
    if lengths is not None:
        steps = torch.arange(T, device=x.device).unsqueeze(1)
        active = (steps < lengths.to(x.device).unsqueeze(0)).unsqueeze(-1)  # [T, n, 1]

    known = output.chunk(directions, dim=-1)
    replays, inputs = [], []
    layer_in = x
    for layer in range(num_layers):
        inputs.append(layer_in)
        top = layer == num_layers - 1
        row = []
        for d in range(directions):
            k = layer * directions + d
            row.append(Recurrence(mode, layer_in, h0[k], None if c0 is None else c0[k], weights[layer][d],
                                  active, reverse=d == 1, out=known[d] if top else None))
        replays.append(row)
        if not top:
            layer_in = row[0].out if directions == 1 else torch.cat([r.out for r in row], dim=-1)
            if masks is not None:
                layer_in = layer_in * masks[layer]
    return replays, inputs
