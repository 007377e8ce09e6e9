"""Ops with a torch and a Triton implementation, one chosen per instance when it is built.

A `CustomOp` subclass writes `forward_native` (plain torch: the reference, and the CPU path)
and `forward_triton` (kernels/, imported inside it, so that a torch build never imports
triton). Construction binds `forward` to one of them, by the build's context:

    with use_triton_kernels(config.kernels == "triton"):
        model = build_model(...)

so the choice is made once, for every op of the model, rather than passed to each
constructor or tested at each call. Outside such a context ops are built with torch.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import nn

_USE_TRITON: ContextVar[bool] = ContextVar("minivllm_use_triton_kernels", default=False)


@contextmanager
def use_triton_kernels(enabled: bool) -> Iterator[None]:
    """Ops (and other build-time kernel choices) made inside take the Triton kernels if
    enabled, torch's otherwise."""
    token = _USE_TRITON.set(enabled)
    try:
        yield
    finally:
        _USE_TRITON.reset(token)


def triton_kernels_enabled() -> bool:
    """Whether what is being built now takes the Triton kernels (use_triton_kernels)."""
    return _USE_TRITON.get()


class CustomOp(nn.Module):
    """An op whose forward is bound at construction to forward_native or forward_triton."""

    def __init__(self) -> None:
        super().__init__()
        self.uses_triton = triton_kernels_enabled()
        # The class's function, not a bound method: a method of self kept on self would be a
        # reference cycle, and the op's weights would outlive a dropped model until the garbage
        # collector's next full pass (and all along while an engine keeps them frozen, gc.freeze).
        self._forward_method: Callable[..., Any] = (type(self).forward_triton if self.uses_triton
                                                    else type(self).forward_native)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(self, *args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_triton(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError
