"""Token logprobs and entropy of a policy's forward, without the [tokens, vocabulary] logits.

`response_log_probs(model, batch)` is what every forward of the trainer computes: log π of
each response token and the entropy at its position, as [B, R] tensors of the padded layout
(0 where nothing was computed), whatever layout the forward ran in (`workers.trainer.packing`).

The LM head is not run by the model: a forward pre-hook on the model's output embedding takes
its input (the last hidden state, after the final norm) and hands the head an empty slice, so
the model computes no logits at all; inside the hook, still within the model's forward (an
FSDP2 root keeps its parameters gathered there), `head_log_probs` computes, for the rows that
predict a selected token only, logits → log-softmax → the target's logprob and the entropy,
`chunk_tokens` rows at a time (`workers.trainer.head`: one autograd function that keeps
only the log-sum-exp and the entropy of each row and recomputes a chunk's logits in the
backward), so memory holds one chunk's [chunk, V] logits, never [tokens, V].
`chunk_tokens=None` is the reference: plain autograd through log-softmax, gather and entropy
on all rows at once; the chunked result equals it up to float summation order (tests: within
1e-6).

The log-softmax and what follows are fp32, whatever the precision of the forward (bf16 under
autocast: the matmul in bf16, as the model's own head would run it). A head with
`final_logit_softcapping` in its config (Gemma) is capped as the model caps it (its chunks
go through autograd, each checkpointed); other logit transforms are not known to this module.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from workers.llm.policy import image_token_id, plain_image_tokens
from workers.trainer.attention import packed_attention
from workers.trainer.batching import TrajectoryBatch
from workers.trainer.exceptions import TrainerError
from workers.trainer.head import chunked_head
from workers.trainer.packing import Layout, layout

__all__ = ["DEFAULT_CHUNK", "forward_log_probs", "head_log_probs", "response_log_probs"]

DEFAULT_CHUNK = 1024


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    softcap: float | None,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    source = logp_all if entropy_grad else logp_all.detach()
    entropy = -(source.exp() * source).sum(dim=-1)
    return logp, entropy


def head_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = DEFAULT_CHUNK,
    entropy_grad: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy), each (N,), of the head `weight` (V, H) on `hidden` (N, H) at `targets`
    (N,); see the module docstring. The entropy carries a gradient only with `entropy_grad`."""
    n = hidden.shape[0]
    if chunk_tokens is None or n == 0:
        return _chunk(hidden, weight, bias, targets, softcap, entropy_grad)
    if not softcap:
        logp, entropy = chunked_head(hidden, weight, bias, targets, chunk_tokens)
        return logp, entropy if entropy_grad else entropy.detach()
    # A capped head (Gemma): each chunk through autograd, checkpointed (recomputed).
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for lo in range(0, n, chunk_tokens):
        args = (hidden[lo : lo + chunk_tokens], weight, bias, targets[lo : lo + chunk_tokens])
        if recompute:
            parts.append(checkpoint(_chunk, *args, softcap, entropy_grad, use_reentrant=False))
        else:
            parts.append(_chunk(*args, softcap, entropy_grad))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _image_token(model: Any) -> int:
    """The model's image token id (-1, no token, for a text model)."""
    token = image_token_id(model.config)
    return -1 if token is None else token


def forward_log_probs(
    model: Any,
    batch: TrajectoryBatch,
    view: Layout,
    *,
    entropy_grad: bool = False,
    precision: str = "fp32",
    chunk_tokens: int | None = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of `model` on `batch` in the layout `view`: (logp, entropy) as [B, R]."""
    head = model.get_output_embeddings()
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    computed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take_hidden(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, view.predict)
        computed.append(
            head_log_probs(
                rows,
                module.weight,
                view.targets,
                bias=module.bias,
                chunk_tokens=chunk_tokens,
                entropy_grad=entropy_grad,
                softcap=softcap,
            )
        )
        return (hidden[..., :0, :], *args[1:])  # the model's own head computes nothing

    # Vision-language policies: the samples' pixel values, in sample order as the image tokens.
    pixels = [t for t in batch.pixels or [] if t is not None]
    images = {"pixel_values": torch.cat(pixels)} if pixels else {}
    ids = batch["input_ids"]
    plain = torch.zeros_like(ids, dtype=torch.bool)
    if images:  # an image token in a response was generated: a plain token, as the engine fed it
        plain[:, batch.prompt_length :] = ids[:, batch.prompt_length :] == _image_token(model)
    handle = head.register_forward_pre_hook(take_hidden)
    try:
        with (
            torch.autocast(ids.device.type, torch.bfloat16, enabled=precision == "bf16"),
            packed_attention(model) if view.packed else nullcontext(),
            plain_image_tokens(model, view.input_ids, view.take(plain)) as fed,
        ):
            model(input_ids=fed, use_cache=False, **view.forward_kwargs(), **images)
    finally:
        handle.remove()
    if len(computed) != 1:
        raise TrainerError(f"the LM head ran {len(computed)} times in one forward, not once")
    logp, entropy = computed[0]
    return view.scatter(logp), view.scatter(entropy)


def response_log_probs(
    model: Any,
    batch: TrajectoryBatch,
    *,
    entropy_grad: bool = False,
    precision: str = "fp32",
    packed: bool = True,
    chunk_tokens: int | None = DEFAULT_CHUNK,
    trained_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(response token) [B, R] and the entropy at each response position [B, R].

    Computed at every real response token (with `trained_only`, at those of `response_mask`
    1), 0 elsewhere; in the packed layout unless `packed=False` (the padded reference). The
    entropy carries a gradient only with `entropy_grad`. With `precision="bf16"` the model
    runs under bf16 autocast; the log-softmax and what follows are fp32 either way.
    """
    view = layout(batch, packed=packed, trained_only=trained_only)
    return forward_log_probs(
        model,
        batch,
        view,
        entropy_grad=entropy_grad,
        precision=precision,
        chunk_tokens=chunk_tokens,
    )
