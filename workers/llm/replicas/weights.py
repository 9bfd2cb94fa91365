"""Loading a trainer checkpoint (safetensors) into a live torch model.

`read_checkpoint` reads and checks everything first, off the engine thread; `copy_into` then
only copies, so an engine pauses for a copy, never for disk I/O, and a checkpoint that does not
fit raises `WeightLoadError` before anything is touched.

Accepted: a directory of `*.safetensors` files (one file or shards; index files are not needed)
or a single `.safetensors` file. Names are those of the model's `state_dict()`; a tied alias
(`lm_head.weight` when embeddings are tied) may be present or absent. Unknown names, missing
parameters and shape mismatches are errors; dtypes are converted to the model's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.llm.replicas.exceptions import WeightLoadError

__all__ = ["copy_into", "read_checkpoint", "targets"]

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
    unknown = sorted(set(state) - set(live))
    if unknown:
        raise WeightLoadError(f"checkpoint has unknown tensors: {unknown[:5]}")
    provided = {id(live[name]) for name in state}
    missing = sorted(name for name, t in live.items() if id(t) not in provided)
    if missing:
        raise WeightLoadError(f"checkpoint lacks tensors: {missing[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(live[name].shape):
            raise WeightLoadError(
                f"{name}: shape {tuple(tensor.shape)} != model's {tuple(live[name].shape)}"
            )
    return state


def copy_into(live: Targets, state: dict[str, torch.Tensor]) -> None:
    """Copy a checked state (from `read_checkpoint`) into the live tensors."""
    with torch.no_grad():
        for name, tensor in state.items():
            live[name].copy_(tensor)
