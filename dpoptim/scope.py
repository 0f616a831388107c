"""Where an engine's forward hooks live: process-wide while it discovers its model, then
only on that model's modules, so that a model without a DP optimizer pays nothing.

An optimizer receives parameters, not a model. Its engine therefore starts with
process-wide module hooks (``register_module_forward_pre_hook`` and friends), which see
every module call in the process, and notes the outermost module call (the *root*,
:mod:`dpoptim.paths`) of each forward pass that used its parameters. Once a step has been
checked against autograd, :meth:`HookScope.narrow` moves the same hooks onto every module
of those roots and removes the process-wide ones: another model in the same process (an
evaluation copy, a teacher, a non-private baseline) then runs without any dpoptim hook.

Each root keeps one extra pre-forward hook that, at every call, hooks modules added to it
since (a layer swapped in, a child attached); new parameters given to the optimizer
(``add_param_group``) send the engine back to process-wide hooks until its next checked
step. A parameter used by a module outside every root after the switch is not seen by
any rule: the backward then reports it as uncovered (never clipped silently), exactly as
for a parameter used outside any module.
"""

from __future__ import annotations

import functools
import weakref

from torch import nn

from . import paths

__all__ = ["HookScope"]


def _rescan_hook(scope_ref, root, args):
    scope = scope_ref()
    if scope is not None:
        scope.cover_new(root)


class HookScope:
    """The forward hooks of one engine. ``hooks`` are its ``(pre, forward, restore)``
    functions, called as ``pre(module, args)``, ``forward(module, args, kwargs, output)``
    and ``restore(module, args, output)`` (the last also when the forward raised).
    ``needs(module)`` says whether a module with no parameters and no children needs them
    once narrowed (see :meth:`_wants_hooks`)."""

    def __init__(self, pre, forward, restore, needs=lambda module: True):
        self._pre, self._forward, self._restore = pre, forward, restore
        self._needs = needs
        self._global: list = []  # handles of the process-wide hooks, while discovering
        self._local: list = []  # handles of the per-module hooks, once narrowed
        self._covered: weakref.WeakSet = weakref.WeakSet()
        self._roots: dict[int, weakref.ref] = {}  # roots whose forwards used the parameters
        self._ref = weakref.ref(self)
        weakref.finalize(self, _remove_all, self._global)
        weakref.finalize(self, _remove_all, self._local)
        self.widen()

    @property
    def narrowed(self) -> bool:
        return not self._global

    # ----------------------------------------------------------------- discovering
    def widen(self) -> None:
        """Process-wide hooks (again): every module call in the process is seen."""
        _remove_all(self._local)
        self._covered = weakref.WeakSet()
        if self._global:
            return
        self._roots.clear()
        self._global += paths.track()  # module paths first, so the engine's hooks know the root
        module = nn.modules.module
        self._global += [
            module.register_module_forward_pre_hook(self._pre),
            module.register_module_forward_hook(self._forward, with_kwargs=True),
            module.register_module_forward_hook(self._restore, always_call=True),
        ]

    def note_root(self, root: nn.Module) -> None:
        """``root``'s forward used the engine's parameters (while discovering)."""
        if self._global and id(root) not in self._roots:
            self._roots[id(root)] = weakref.ref(root)

    # ----------------------------------------------------------------- narrowed
    def narrow(self) -> bool:
        """Move the hooks onto the modules of the roots seen; False when none is known."""
        if not self._global:
            return True
        roots = [r for r in (ref() for ref in self._roots.values()) if r is not None]
        if not roots:
            return False
        _remove_all(self._global)
        for root in roots:
            self._local.append(root.register_forward_pre_hook(functools.partial(_rescan_hook, self._ref),
                                                              prepend=True))
            self.cover_new(root)
        return True

    def cover_new(self, root: nn.Module) -> None:
        """Hook every module of ``root`` not hooked yet (that wants hooks)."""
        for module in root.modules():
            if module not in self._covered:
                self._covered.add(module)
                if module is root or self._wants_hooks(module):
                    self._cover(module)

    def _wants_hooks(self, module: nn.Module) -> bool:
        """Whether a module inside a root needs the hooks. A leaf without parameters and
        without a rule (an activation, dropout, a reshape) neither uses a parameter nor
        encloses a module that does, and no rule watches it: its calls need no hook, and
        skipping them saves most of the cost of calling it. A parameter given to it later
        is not the optimizer's (``add_param_group`` widens the hooks again), and a child
        attached to it later is hooked by the root's rescan."""
        if next(module.children(), None) is not None or next(module.parameters(recurse=False), None) is not None:
            return True
        return self._needs(module)

    def _cover(self, module: nn.Module) -> None:
        # Prepended, in reverse, so that they run before the module's own hooks and in the
        # order the process-wide ones do: paths, then the engine.
        handles = [
            module.register_forward_pre_hook(self._pre, prepend=True),
            module.register_forward_hook(self._restore, prepend=True, always_call=True),
            module.register_forward_hook(self._forward, prepend=True, with_kwargs=True),
        ]
        handles += paths.hook_module(module)
        self._local += handles

    def close(self) -> None:
        _remove_all(self._global)
        _remove_all(self._local)


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
