"""Loading a trainer checkpoint (safetensors) into a live torch model.

`read_checkpoint` reads and checks everything first, off the engine thread; `copy_into` then
only copies, so an engine pauses for a copy, never for disk I/O, and a checkpoint that does not
fit raises `WeightLoadError` before anything is touched.

Accepted: a directory of `*.safetensors` files (one file or shards; index files are not needed)
or a single `.safetensors` file. Names are those of the model's `state_dict()`; a tied alias
(`lm_head.weight` when embeddings are tied) may be present or absent. Unknown names, missing
parameters and shape mismatches are errors; dtypes are converted to the model's.

Mixture-of-Experts checkpoints come in the hub's layout, one tensor per expert
(`….experts.<e>.{gate,up,down}_proj.weight`, what `save_pretrained` writes), while transformers
5 holds a layer's experts as two 3-d parameters (`….experts.gate_up_proj` [E, 2I, H], gate rows
first, and `….experts.down_proj` [E, H, I]); `read_checkpoint` stacks the former into the latter
when the model has them (transformers' own `qwen2_moe` conversion, which Qwen3-MoE shares).

`receive_checked(grant, live)`, in an `hf` replica: receives a granted broadcast
(`workers.weights.receive`) and checks it against the served model like a checkpoint
(`check_state`), raising `WeightLoadError` for tensors that do not fit and
`WeightTransferError` when they did not arrive. (A vLLM replica receives in its workers:
`vllm_worker.WeightSync`.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from workers.weights.exceptions import WeightLoadError, WeightTransferError

__all__ = ["check_state", "copy_into", "read_checkpoint", "receive_checked", "targets"]

Targets = dict[str, torch.Tensor]


def targets(model: torch.nn.Module) -> Targets:
    """Every state-dict name of `model` → its live tensor (tied names share one tensor)."""
    return dict(model.state_dict(keep_vars=True).items())


def _files(path: Path) -> list[Path]:
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if path.is_dir():
        found = sorted(path.glob("*.safetensors"))
        if found:
            return found
        raise WeightLoadError(f"no *.safetensors files in {path}")
    raise WeightLoadError(f"checkpoint path {path} does not exist")


def read_checkpoint(path: str | Path, live: Targets) -> dict[str, torch.Tensor]:
    """Read the checkpoint at `path` and check it against `live`; returns name → tensor."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in _files(Path(path)):
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise WeightLoadError(f"cannot read {file}: {exc}") from exc
    return check_state(_stack_experts(state, live), live)


def check_state(
    state: dict[str, torch.Tensor], live: Targets, *, what: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """`state` if it names exactly the model's tensors (a tied alias may be absent) in their
    shapes; else WeightLoadError saying what differs (`what`: where the tensors came from)."""
    unknown = sorted(set(state) - set(live))
    if unknown:
        raise WeightLoadError(f"{what} has unknown tensors: {unknown[:5]}")
    provided = {id(live[name]) for name in state}
    missing = sorted(name for name, t in live.items() if id(t) not in provided)
    if missing:
        raise WeightLoadError(f"{what} lacks tensors: {missing[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(live[name].shape):
            raise WeightLoadError(
                f"{name}: shape {tuple(tensor.shape)} != model's {tuple(live[name].shape)}"
            )
    return state


_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def _stack_experts(state: dict[str, torch.Tensor], live: Targets) -> dict[str, torch.Tensor]:
    """Per-expert tensors → the model's stacked `gate_up_proj` / `down_proj` (module docstring);
    anything else, and per-expert names the model has itself, pass through unchanged."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _EXPERT.match(name)
        if m is None or f"{m['prefix']}.down_proj" not in live:
            out[name] = tensor
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = tensor
    for prefix, projs in groups.items():
        experts = int(live[f"{prefix}.down_proj"].shape[0])
        for proj in ("gate", "up", "down"):
            have = projs.get(proj, {})
            if sorted(have) != list(range(experts)):
                raise WeightLoadError(
                    f"{prefix}: checkpoint has {proj}_proj of experts {sorted(have)[:8]}, "
                    f"the model has {experts}"
                )
        gate, up, down = (
            torch.stack([projs[p][e] for e in range(experts)]) for p in ("gate", "up", "down")
        )
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = down
    return out


def copy_into(live: Targets, state: dict[str, torch.Tensor]) -> None:
    """Copy a checked state (from `read_checkpoint`) into the live tensors."""
    with torch.no_grad():
        for name, tensor in state.items():
            live[name].copy_(tensor)


def receive_checked(
    grant: dict[str, Any], live: dict[str, torch.Tensor], pool: list[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The granted weights, checked against the model's tensors `live` (the module's docstring);
    `pool`: the replica's receive buffers, kept from one transfer to the next."""
    from workers.weights.protocol import Grant
    from workers.weights.receive import receive

    try:
        if Grant.loads(grant).backend != "gloo":
            raise WeightLoadError("the hf replica receives over gloo only (CPU tensors)")
        state = receive(grant, pool=pool)
    except ValueError as exc:
        raise WeightLoadError(f"transfer refused: {exc}") from exc
    except RuntimeError as exc:  # torch's store errors, gloo's timeouts and broken connections
        raise WeightTransferError(f"transfer failed: {str(exc).strip()[-300:]}") from exc
    return check_state(state, live, what="transfer")
