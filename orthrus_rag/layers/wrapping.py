"""Wrapping a model's submodule in place (LoRA slots, full row deltas): the wrapper is made once per module and
takes the wrapped module's place in its parent, so later adapters add to the same wrapper."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def wrap_once(model: nn.Module, modules: dict[str, nn.Module], name: str, wrapper: type,
              make: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The `wrapper` around `modules[name]`, made (by `make`, default `wrapper(module)`) and put in its parent's
    place the first time; `modules` (from `model.named_modules()`) is kept current."""
    target = modules[name]
    if isinstance(target, wrapper):
        return target
    target = (make or wrapper)(target)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, target)
    modules[name] = target
    return target
