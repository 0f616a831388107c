"""The clipping math of one backward pass (book-keeping, Bu et al. 2023).

At the end of each ``backward()`` the uses of its group (see :mod:`dpoptim.capture`) share
one example axis. Per-example squared norms come from every use's rule (``Rule.norms``;
a parameter shared by several uses gets its cross terms from the rules' factored terms,
:func:`_norms_of_terms`, or from materialised per-example gradients, as
:func:`dpoptim.cost.ghost_is_cheaper` decides); the clip factors ``c_i = min(1, C/||g_i||)``
come from :func:`dpoptim.privatize.clip_factors`; each parameter's clipped sum
``sum_i c_i g_i`` (``Rule.clipped_sum``) is added to the running sums. The small functions
here are pure; :class:`ClippingMixin` holds the engine's steps that apply them to a group.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref

import torch

from . import _torch, cost, fsdp, paths, verify
from .capture import _Group
from .errors import PrivacyWarning
from .nested import map_tensors
from .privatize import clip_factors
from .registry import Use

__all__ = ["ClippingMixin"]


def _finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) if t.is_floating_point() else t


_USED_ELSEWHERE = (
    "It is used somewhere dpoptim cannot see (a functional call on the weight, a loss term on "
    "the parameters), or its module's rule is wrong. Route every use through a module with a "
    "rule; put weight penalties in the optimizer's weight_decay."
)


def _check_one_example_axis(squared: list, sizes: set) -> None:
    """Refuse a backward whose layers' per-example norms disagree on the number of examples."""
    if len({s.shape[0] for s in squared}) > 1:
        found = ", ".join(sorted(f"{paths.describe(module)}: {n}" for module, n in sizes))
        raise RuntimeError(
            f"the layers of one backward() disagree on the number of examples ({found}): a "
            "layer received a tensor whose first dimension is not the batch, such as a sequence-first "
            "[T, n, d] output, or indices without the batch dimension (a lookup shared by all examples "
            "needs a first dimension of 1, as position ids [1, T] have). Per-example rules read "
            "examples from dimension 0: use batch_first=True, transpose, or give shared indices a "
            "leading dimension of 1."
        )


def _drop_non_finite(total: torch.Tensor, uses: list, shared: dict) -> tuple[list, dict]:
    """Examples with a non-finite norm get clip factor 0 (:func:`dpoptim.privatize.clip_factors`);
    their non-finite inputs are zeroed too, so that ``0 * inf`` cannot reach the sums."""
    warnings.warn(
        f"{int((~torch.isfinite(total)).sum())} example(s) had a non-finite gradient; their "
        "contribution was dropped (clip factor 0). The step still adds noise and is charged.",
        PrivacyWarning,
        stacklevel=3,
    )
    uses = [(r, Use(u.module, map_tensors(_finite_or_zero, u.saved), map_tensors(_finite_or_zero, u.grad_outputs)))
            for r, u in uses]
    return uses, {pid: _finite_or_zero(g) for pid, g in shared.items()}


def _check_examples_against_model(uses, n: int) -> None:
    """Refuse a backward whose layers saw ``n`` examples while the model they ran in was
    called with another number: the examples were reshaped on the way (tokens flattened
    into the batch dimension, a sequence-first tensor through Linear layers, the batch cut
    into chunks), and each row a layer sees would be clipped as an example of its own."""
    seq_first = any(getattr(record.module, "batch_first", True) is False for record, _ in uses)
    for record, _ in uses:
        root = record.root
        if root is None or root.sizes is None:
            continue
        first, second = root.sizes
        model = root.module()
        if n == first or (seq_first and n == second):
            continue
        raise RuntimeError(
            f"{type(record.module).__name__} saw {n} examples, but the model around it "
            f"({type(model).__name__}) was called with a batch of {first} (the first dimension of "
            "its first argument): the examples were reshaped on the way, so each row a layer sees "
            "would be clipped as an example of its own. Keep dimension 0 the example in every layer "
            "(reshape [n, T, d] -> [n * T, d] and back is not allowed; Linear and Embedding take "
            "[n, T, d] as they are; pass batch_first=True to recurrent and attention layers), and "
            "pass the batch as the model's first argument."
        )


def _norms_of_terms(terms) -> torch.Tensor:
    """``||sum_u g_i^u||^2`` per example from factored terms (see ``Rule.terms``): with all
    rows of all uses stacked, ``sum_{t,s} (out_t . out_s)(inp_t . inp_s)``, cross terms
    between uses included. Index rows (one-hot) and dense rows are stacked separately."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for pair in terms for t in pair
                                                   if t is not None and t.is_floating_point()), torch.float32)

    def stack(group):
        out = torch.cat([o if not o.is_floating_point() else o.to(dtype) for o, _ in group], dim=1)
        inp = None if group[0][1] is None else torch.cat([i.to(dtype) for _, i in group], dim=1)
        return out, inp

    dense = [pair for pair in terms if pair[0].is_floating_point()]
    index = [pair for pair in terms if not pair[0].is_floating_point()]
    groups = [stack(g) for g in (dense, index) if g]
    total = None
    for a in range(len(groups)):
        for b in range(a, len(groups)):
            value = _term_inner(groups[a], groups[b], dtype)
            value = value if a == b else 2 * value
            total = value if total is None else total + value
    return total


def _term_inner(x, y, dtype) -> torch.Tensor:
    """``sum_{t,s} (out^x_t . out^y_s)(inp^x_t . inp^y_s)`` per example."""
    (ox, ix), (oy, iy) = x, y
    if ox.is_floating_point() and oy.is_floating_point():
        outer = torch.bmm(ox, oy.transpose(1, 2))
    elif ox.is_floating_point():  # rows of ox read at y's indices
        outer = ox.gather(2, oy.long().unsqueeze(1).expand(-1, ox.shape[1], -1))
    elif oy.is_floating_point():
        outer = oy.gather(2, ox.long().unsqueeze(1).expand(-1, oy.shape[1], -1)).transpose(1, 2)
    else:
        outer = (ox.unsqueeze(2) == oy.unsqueeze(1)).to(dtype)
    if ix is None:
        return outer.sum((1, 2))
    return (outer * torch.bmm(ix, iy.transpose(1, 2))).sum((1, 2))


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite: one reduction when its sum is finite (a
    sum with a non-finite term is not), the elementwise test only when the sum is not."""
    return math.isfinite(t.sum()) or bool(torch.isfinite(t).all())


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _add_into(sums, p, value):
    value = value.to(p.dtype)
    current = sums.get(id(p))
    sums[id(p)] = value if current is None else current.add_(value)


class _no_autocast:
    """Rules run with autocast off: norms and factors in float32 or wider. Nothing to do
    when it is off already (a backward outside any autocast region, the usual case)."""

    def __enter__(self):
        self._contexts = []
        if torch.is_autocast_enabled("cpu"):
            self._contexts.append(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available() and torch.is_autocast_enabled("cuda"):
            self._contexts.append(torch.autocast("cuda", enabled=False))
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._contexts):
            c.__exit__(*exc)


class ClippingMixin:
    """The engine's processing of one backward's group (see the module docstring)."""

    # ----------------------------------------------------------------- the math of one group
    def _process(self, group: _Group) -> None:
        self.backward_calls += 1
        self.seen.update(group.accumulated)
        if group.mixing:
            # Per-example gradients do not exist: nothing of this backward is clipped.
            self._errors.extend(group.mixing.values())
            return
        counts: dict[int, int] = {}
        for record, _ in group.uses.values():
            for _, p in record.params:
                counts[id(p)] = counts.get(id(p), 0) + 1
        for pid, p in group.accumulated.items():
            if pid not in counts:
                self._errors.append(self._uncovered_message(p))
            elif pid in self._ghosts:
                self._errors.append(f"{self._describe(p)}: {_USED_ELSEWHERE}")
        if not group.uses:
            return

        if not self._warned_eval:
            idle = sorted({type(r.module).__name__ for r, _ in group.uses.values() if not r.module.training})
            if idle:
                self._warned_eval = True
                warnings.warn(
                    f"backward() ran through modules in eval mode ({', '.join(idle)}) while training: "
                    "did you forget model.train()? Dropout and similar layers behave differently.",
                    PrivacyWarning,
                    stacklevel=2,
                )
        uses = [(record, Use(record.module, record.saved, grads, record.cache)) for record, grads in group.uses.values()]
        gathered = self._gather_released([record for record, _ in uses]) if self._fsdp_owner else []
        stream = None
        if self._fsdp_owner:
            uses, stream = self._shard_stream(uses, counts)
        try:
            with _no_autocast():
                self._process_uses(group, uses, counts, stream)
        finally:
            for module in gathered:
                module.reshard()

    def _process_uses(self, group, uses, counts, stream=None):
        # A parameter of several uses (tied weights, a module called twice) needs the cross
        # terms between its uses: from the rules' factored terms when all offer them and
        # that is cheaper, else from materialised per-example gradients.
        factored = self._shared_terms(uses, counts)
        by_terms = set(factored)

        def summed(record):  # the rule computes these clipped sums itself
            return [n for n, p in record.params if counts[id(p)] == 1 or id(p) in by_terms]

        total, shared = self._squared_norms(uses, counts, factored)
        del factored  # their tensors belong to the uses, released in _add_clipped
        n = total.shape[0]
        _check_examples_against_model(uses, n)
        scale = float(n) if self.loss_reduction == "mean" else 1.0
        total = total * (scale * scale)
        bound = float(self._max_grad_norm())
        weights = clip_factors(total, bound) * scale
        if n and not _all_finite(total):
            uses, shared = _drop_non_finite(total, uses, shared)
        self._add_clipped(group, uses, shared, weights.to(total.dtype), summed, stream)
        if self._verify:
            self._keep_for_check(group, uses, shared, summed, torch.ones_like(total))
        self.examples += n
        self._clip_norms.add(bound)
        self._mark_grads(group.accumulated)

    def _squared_norms(self, uses, counts, factored):
        """``||g_i||^2`` per example over all parameters of the group (in float32 or wider),
        and the materialised per-example gradients of the shared parameters without terms."""
        squared, sizes = [], set()
        for record, use in uses:
            names = [n for n, p in record.params if counts[id(p)] == 1]  # the rule's own norms
            if names:
                norms = self._checked_norms(record, use, names)
                sizes.add((record.module, norms[0].shape[0]))  # described only if the sizes disagree
                squared.extend(norms)
        squared.extend(_norms_of_terms(terms) for terms in factored.values())
        shared = self._shared_per_example(uses, counts, skip=set(factored))
        squared.extend(g.flatten(1).square().sum(1) for g in shared.values())
        _check_one_example_axis(squared, sizes)
        return functools.reduce(torch.add, (_wide(s) for s in squared)), shared

    def _add_clipped(self, group, uses, shared, weights, summed, stream=None) -> None:
        """Add each parameter's clipped sum ``sum_i w_i g_i`` to the running sums. Off the
        checked first step nothing needs a use after its clipped sum: its saved inputs,
        output gradients and rule cache go at once, so that the last clipped sums run with
        the earlier layers' activations already freed. Under FSDP2 ``stream`` reduces each
        block's sums to shards as soon as they are complete."""
        release = not self._verify
        n = weights.shape[0]
        for i, (record, use) in enumerate(uses):
            problem = verify.check_route(record, use, [name for name, _ in record.params], n, self._autocast_seen)
            if problem is not None:  # a run-time path taken for the first time, and wrong
                self._errors.append(problem)
            names = summed(record)
            if names:
                self._accumulate(self._sums, record, record.rule.clipped_sum(use, names, weights))
            if stream is not None:
                stream.done(self._blocks_of(record))
            if release:
                uses[i] = None
                group.uses.pop(id(record), None)
                record.saved, record.cache, record.released = None, {}, True
                del record, use
        for pid, g in shared.items():
            _add_into(self._sums, self._params[pid], torch.tensordot(weights.to(g.dtype), g, dims=1))
        if stream is not None:
            stream.finish()

    def _keep_for_check(self, group, uses, shared, summed, ones) -> None:
        """On the checked first step: the rules' unclipped sums and autograd's gradients,
        compared in ``step()`` (:func:`dpoptim.verify.compare_sums`)."""
        for record, use in uses:
            names = summed(record)
            if names:
                self._accumulate(self._raw_sums, record, record.rule.clipped_sum(use, names, ones))
        for pid, g in shared.items():
            _add_into(self._raw_sums, self._params[pid], g.sum(0))
        for pid, g in group.autograd.items():
            _add_into(self._autograd_sums, self._params[pid], g)
        for record, _ in uses:  # the record outlives this backward: its cache need not
            record.cache = {}

    def _mark_grads(self, accumulated: dict) -> None:
        """Remember what backward left in ``.grad`` (see :meth:`_follow_cleared_grads`). An
        all-zero gradient is no evidence either way (zeroing it changes nothing), so only
        non-zero ones are marked: one device sync for all of them."""
        grads = [(pid, p.grad) for pid, p in accumulated.items() if p.grad is not None and not p.grad.is_sparse]
        if self._sharded:
            grads = [(pid, fsdp.local(g)) for pid, g in grads]  # an FSDP2 gradient: this rank's shard
        if not grads:
            return
        device = grads[0][1].device
        if device.type == "cpu":  # no device to wait for: read each flag as it is computed
            nonzero = [bool(g.any()) for _, g in grads]
        else:
            nonzero = torch.stack([g.any() if g.device == device else g.any().to(device) for _, g in grads]).tolist()
        for (pid, g), keep in zip(grads, nonzero):
            if keep:
                self._marks[pid] = (weakref.ref(g), _torch.version_counter(g))

    def _checked_norms(self, record, use, names):
        norms = record.rule.norms(use, names)
        for name in names:
            if name not in norms or norms[name].dim() != 1:
                raise RuntimeError(
                    f"{type(record.rule).__name__}.norms must return a 1-D tensor for '{name}' "
                    f"of {type(record.module).__name__}"
                )
        return [norms[name] for name in names]

    def _shared_terms(self, uses, counts) -> dict[int, list]:
        """Factored terms of every shared parameter whose uses all offer them and whose
        ghost norm (a Gram matrix over all its rows) costs less than materialising."""
        terms: dict[int, list] = {}
        refused: set[int] = set()
        for record, use in uses:
            for name, p in record.params:
                if counts[id(p)] > 1 and id(p) not in refused:
                    found = record.rule.terms(use, name)
                    if found is None:
                        refused.add(id(p))
                    else:
                        terms.setdefault(id(p), []).extend(found)
        out = {}
        for pid, found in terms.items():
            if pid in refused:
                continue
            p = self._params[pid]
            rows = sum(out_side.shape[1] for out_side, _ in found)
            d = p[0].numel() if p.dim() > 1 else 1
            if cost.ghost_is_cheaper(rows, d, p.shape[0], examples=found[0][0].shape[0]):
                out[pid] = found
        return out

    def _shared_per_example(self, uses, counts, skip=()):
        shared: dict[int, torch.Tensor] = {}
        for record, use in uses:
            for name, p in record.params:
                if counts[id(p)] > 1 and id(p) not in skip:
                    g = record.rule.per_example(use, [name])[name]
                    shared[id(p)] = g if id(p) not in shared else shared[id(p)] + g
        return shared

    def _accumulate(self, sums, record, values):
        for name, p in record.params:
            if name not in values:
                continue
            value = values[name]
            if value.shape != p.shape:
                raise RuntimeError(
                    f"{type(record.rule).__name__}.clipped_sum returned shape {tuple(value.shape)} for "
                    f"'{name}' of {type(record.module).__name__}, expected {tuple(p.shape)}"
                )
            _add_into(sums, p, value)
