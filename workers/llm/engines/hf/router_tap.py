"""Routed experts of the `hf` engine's own forward passes, read off each MoE layer's router.

transformers 5 gives every Mixture-of-Experts layer a router module (`*TopKRouter`, at
`mlp.gate` in Qwen2/Qwen3-MoE) whose forward returns `(router_logits, routing_weights,
selected_experts)` for the layer's input flattened to (rows × positions, hidden). `RouterTap`
puts a forward hook on each and, while `capture()` is on, keeps `selected_experts` of that
forward; `take()` stacks them to (positions, MoE layers, top_k) in the model's layer order.

Rows map back to requests because the engine never feeds padding: a prefill feeds one
sequence's uncached tokens, a decode step feeds exactly one real token per running row (the
batch's left padding lives only in the KV cache and the attention mask). So in a prefill row
`j` is the sequence's position `reuse + j`, and in a decode step row `i` is `rows[i]`'s newest
position.

Cost when nothing is captured: one Python call per MoE layer per forward that returns at once;
no tensor is kept or copied. Not thread-safe: only the engine thread runs forwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch

from schemas.routing import routing_dtype

__all__ = ["RouterTap", "capture"]


def _is_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")


class RouterTap:
    """Forward hooks on a model's MoE routers; see the module docstring."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        first = routers[0]
        self.layers = len(routers)
        self.top_k = int(first.top_k)  # type: ignore[arg-type]
        self.num_experts = int(first.num_experts)  # type: ignore[arg-type]
        self._dtype = np.dtype(routing_dtype(self.num_experts))
        self._torch_dtype = torch.uint8 if self._dtype == np.uint8 else torch.int16
        self._on = False
        self._taken: list[torch.Tensor | None] = [None] * self.layers
        for index, router in enumerate(routers):
            router.register_forward_hook(self._hook(index))

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RouterTap | None:
        """Hook every router of `model`; None for a dense model (no router)."""
        routers = [m for m in model.modules() if _is_router(m)]
        return cls(routers) if routers else None

    def _hook(self, index: int):  # type: ignore[no-untyped-def]
        def keep(_module: torch.nn.Module, _args: object, output: tuple[torch.Tensor, ...]) -> None:
            if self._on:
                self._taken[index] = output[2]

        return keep

    @contextmanager
    def capture(self, on: bool) -> Iterator[None]:
        """Keep the routing of the forwards run inside (when `on`), for `take()`."""
        self._on, self._taken = on, [None] * self.layers
        try:
            yield
        finally:
            self._on = False

    def take(self) -> np.ndarray:
        """The captured forward's routing, (positions, layers, top_k), packed dtype."""
        if any(t is None for t in self._taken):
            raise RuntimeError("a MoE layer did not route during the captured forward")
        stacked = torch.stack(self._taken, dim=1)  # type: ignore[arg-type]
        self._taken = [None] * self.layers
        return stacked.to(self._torch_dtype).numpy()


def capture(tap: RouterTap | None, on: bool) -> AbstractContextManager[None]:
    """`tap.capture(on)`, or nothing for a dense model (no tap)."""
    return tap.capture(on) if tap is not None else nullcontext()
