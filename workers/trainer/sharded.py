"""The trainer over N ranks (torchrun): FSDP2-sharded policy, one rank that talks to Kafka.

Roles:
- Rank 0 is the ordinary `Trainer` (consumer, staleness, dedup, ledger, step log, checkpoint
  positions, `PolicyVersion`), with three hooks replaced: the policy is built sharded, a step is
  `sharded_train_step`, a checkpoint is written collectively. Before each step it broadcasts the
  step's groups (their Kafka bytes, decoded and collated identically on every rank), then, for a
  vision-language policy, the batch's pixel values (`send_pixels`: the other ranks read no media
  store, so they need none, and see exactly the pixels rank 0 checked); before each checkpoint
  it broadcasts the version; when it stops it broadcasts stop.
- Ranks > 0 (`_follow`) only obey those commands. They read nothing from Kafka and decide
  nothing, so the exactly-once accounting is the one-process trainer's, unchanged: the groups
  of a step, the weights they produced and the offsets after them are checkpointed together.

Checkpoints (both written before `latest` names `step-N/`):
- `sharded/step-N/`: the distributed checkpoint (torch.distributed.checkpoint) of the policy and
  its AdamW, each rank writing its shards; a restart with the same or another rank count
  reloads it (DCP reshards).
- `step-N/`: the consolidated safetensors, gathered to and written by rank 0 through the
  one-process `save_checkpoint`, so replicas, `latest`, pruning and `PolicyVersion` stay as
  they are. No optimizer state there: the sharded one is the truth.
A rank ends with `leave_rank` (no interpreter teardown: see there). A rank that dies makes
torchrun stop the others; the restart resumes from `latest` (steps after it are trained again
from its weights, as with one process).

Commands travel on a gloo group with a long timeout (rank 0 may wait on an idle topic for
hours); FSDP2's collectives use the default group (gloo on cpu, nccl on cuda), and the step's own
(its loss and metric rows, CPU tensors) the gloo control group, since NCCL takes no CPU tensor.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.metrics import TrainerMetrics
from workers.trainer.config import TrainerConfig
from workers.trainer.exceptions import CheckpointError, DeviceError, TrainerError
from workers.trainer.trainer import Trainer, TrainerResult
from workers.weights.checkpoint import TrainerState, load_latest, save_checkpoint

__all__ = [
    "Policy",
    "build_policy",
    "init_ranks",
    "leave_rank",
    "recv_pixels",
    "run_sharded_trainer",
    "send_pixels",
    "train_policy",
    "world_size",
]

log = logging.getLogger("rollout.trainer.sharded")

STOP, STEP, SAVE, PIXELS = 0, 1, 2, 3
SHARDED_DIR = "sharded"
CONTROL_TIMEOUT = timedelta(days=30)


def world_size() -> int:
    """The torchrun world size of this process (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class Ranks:
    rank: int
    world: int
    device: torch.device
    mesh: Any
    control: Any  # gloo process group for commands


def init_ranks(config: TrainerConfig) -> Ranks:
    """Join the torchrun world: nccl and `cuda:LOCAL_RANK` when the trainer's device is a GPU
    that this node has, else gloo on cpu."""
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = config.device != "cpu" and torch.cuda.is_available()
    if config.device.startswith("cuda") and not gpu:
        # A rank the launcher gave no GPU (CUDA_VISIBLE_DEVICES=""): never another's cuda:0.
        raise DeviceError(
            f"trainer.device={config.device}: this rank sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}); "
            "trainer.device=auto trains on the CPU"
        )
    if gpu and local >= torch.cuda.device_count():
        raise DeviceError(
            f"rank {os.environ.get('RANK', '?')}: LOCAL_RANK {local}, but it sees "
            f"{torch.cuda.device_count()} CUDA device(s): each rank's node must give its ranks "
            "one GPU each"
        )
    if gpu:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if gpu else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", local) if gpu else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Ranks(dist.get_rank(), world, device, mesh, control)


@dataclass
class Policy:
    model: Any
    optimizer: torch.optim.Optimizer
    ref_model: Any | None
    pad_token_id: int


def _shard(model: Any, ranks: Ranks, precision: str) -> Any:
    """`fully_shard` on every decoder layer (the model's `_no_split_modules`), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
        reduce_dtype=torch.float32,
    )
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise CheckpointError(f"{type(model).__name__}: no decoder layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=ranks.mesh, mp_policy=mp)
    fully_shard(model, mesh=ranks.mesh, mp_policy=mp)
    return model


def build_policy(config: TrainerConfig, source: Path, state: TrainerState, ranks: Ranks) -> Policy:
    """The sharded policy from `source` (a vision-language one too: its vision tower's layers
    are sharded like the decoder's), its AdamW restored from `sharded/step-<version>/` when the
    checkpoint has one, and the sharded frozen reference when `kl_coef > 0`."""
    from workers.trainer.images import load_policy

    def load(path: str | Path) -> Any:
        model = load_policy(path, dtype=torch.float32)
        return _shard(model.to(ranks.device), ranks, config.precision)

    model = load(source)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )
    root = Path(config.checkpoint_dir).resolve()
    if state.version > 0 and not _load_sharded(
        root / SHARDED_DIR / f"step-{state.version}", model, optimizer
    ):
        log.warning("no sharded state for version %d; AdamW starts fresh", state.version)
    ref = None
    if config.kl_coef > 0:
        ref = load(state.source_model or config.model_dir).eval().requires_grad_(False)
    pad = model.config.get_text_config().pad_token_id  # a VL model: its LM's
    return Policy(model, optimizer, ref, int(pad) if pad is not None else 0)


def train_policy(policy: Policy, batch: Any, config: TrainerConfig, ranks: Ranks) -> dict[str, Any]:
    """This rank's share of one trainer step of `policy` on `batch` (`sharded_train_step`,
    against the policy's frozen reference when it has one); every rank calls it alike."""
    from workers.trainer.sharded_step import sharded_train_step

    return sharded_train_step(
        policy.model,
        policy.optimizer,
        batch,
        config,
        rank=ranks.rank,
        world=ranks.world,
        group=ranks.control,
        ref_model=policy.ref_model,
    )


def _load_sharded(path: Path, model: Any, optimizer: torch.optim.Optimizer) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / ".metadata").is_file():
        return False
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return True


def save_sharded(root: Path, version: int, policy: Policy, ranks: Ranks) -> dict[str, Any]:
    """Collective: write `sharded/step-<version>/` and return the full state dict (rank 0; empty
    elsewhere). A leftover directory of that version was never named by `latest`: replaced."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    folder = root / SHARDED_DIR / f"step-{version}"
    if ranks.rank == 0:
        _prune_sharded(root, keep_version=version)
        shutil.rmtree(folder, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=ranks.control)
    msd, osd = get_state_dict(policy.model, policy.optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(policy.model, options=options)


def _prune_sharded(root: Path, *, keep_version: int) -> None:
    """Drop sharded states whose consolidated `step-N/` was pruned (or never completed)."""
    for item in (root / SHARDED_DIR).glob("step-*"):
        if item.name != f"step-{keep_version}" and not (root / item.name).is_dir():
            shutil.rmtree(item, ignore_errors=True)


class _Consolidated:
    """What `save_checkpoint` calls `save_pretrained` on: the model with its gathered weights."""

    def __init__(self, model: Any, full: dict[str, Any]) -> None:
        self.model, self.full = model, full

    def save_pretrained(self, path: str, *, safe_serialization: bool = True) -> None:
        self.model.save_pretrained(path, state_dict=self.full, safe_serialization=True)


def _send(ranks: Ranks, kind: int, value: int = 0, payload: list[bytes] | None = None) -> None:
    payload = payload or []
    head = torch.tensor([kind, value, len(payload)], dtype=torch.int64)
    dist.broadcast(head, 0, group=ranks.control)
    if payload:
        sizes = torch.tensor([len(p) for p in payload], dtype=torch.int64)
        dist.broadcast(sizes, 0, group=ranks.control)
        data = torch.frombuffer(bytearray(b"".join(payload)), dtype=torch.uint8)
        dist.broadcast(data, 0, group=ranks.control)


def _recv(ranks: Ranks) -> tuple[int, int, list[bytes]]:
    head = torch.zeros(3, dtype=torch.int64)
    dist.broadcast(head, 0, group=ranks.control)
    kind, value, count = (int(x) for x in head)
    if not count:
        return kind, value, []
    sizes = torch.zeros(count, dtype=torch.int64)
    dist.broadcast(sizes, 0, group=ranks.control)
    data = torch.zeros(int(sizes.sum()), dtype=torch.uint8)
    dist.broadcast(data, 0, group=ranks.control)
    raw, out, at = data.numpy().tobytes(), [], 0
    for size in sizes.tolist():
        out.append(raw[at : at + size])
        at += size
    return kind, value, out


def send_pixels(ranks: Ranks, pixels: list[torch.Tensor | None]) -> None:
    """Rank 0: a batch's pixel values (one tensor per sample, None without images) to the
    other ranks, as raw float32 with their shapes (no pickle)."""
    _send(ranks, PIXELS, payload=[b"" if p is None else _tensor_bytes(p) for p in pixels])


def recv_pixels(ranks: Ranks, device: torch.device) -> list[torch.Tensor | None]:
    """Ranks > 0: what `send_pixels` sent, on `device`."""
    kind, _, payload = _recv(ranks)
    if kind != PIXELS:
        raise TrainerError(f"rank {ranks.rank}: expected the step's pixels, got command {kind}")
    return [_tensor_from(b).to(device) if b else None for b in payload]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A float32 tensor as (ndim, shape..., data), little-endian int64 header."""
    data = tensor.detach().to("cpu", torch.float32).contiguous()
    head = torch.tensor([data.dim(), *data.shape], dtype=torch.int64)
    return head.numpy().astype("<i8").tobytes() + data.numpy().astype("<f4").tobytes()


def _tensor_from(raw: bytes) -> torch.Tensor:
    import numpy as np

    ndim = int(np.frombuffer(raw, dtype="<i8", count=1)[0])
    shape = [int(x) for x in np.frombuffer(raw, dtype="<i8", count=ndim, offset=8)]
    data = np.frombuffer(raw, dtype="<f4", offset=8 * (ndim + 1))
    return torch.from_numpy(data.copy()).reshape(shape)


def _batch(payload: list[bytes], pad_token_id: int, device: torch.device) -> Any:
    from schemas.codec import decode
    from workers.trainer.batching import collate_groups

    return collate_groups([decode(b) for b in payload], pad_token_id=pad_token_id).to(device)


class ShardedTrainer(Trainer):
    """Rank 0: the `Trainer` with the sharded hooks (see the module docstring)."""

    ranks: Ranks

    def _build_model(self, ckpt: Any) -> None:
        self.device = self.ranks.device
        self.policy = build_policy(self.config, Path(self.source), self.state, self.ranks)
        self.model, self.optimizer = self.policy.model, self.policy.optimizer
        self.ref_model = self.policy.ref_model

    def _step(self, pending: Any) -> None:
        _send(self.ranks, STEP, payload=[item.value for item in pending.train])
        super()._step(pending)

    def _attach_images(self, batch: Any) -> Any:
        batch = super()._attach_images(batch)
        send_pixels(self.ranks, batch.pixels)
        return batch

    def _train(self, batch: Any) -> dict[str, Any]:
        return train_policy(self.policy, batch, self.config, self.ranks)

    def _save(self, state: TrainerState) -> Path:
        _send(self.ranks, SAVE, value=state.version)
        full = save_sharded(self.root, state.version, self.policy, self.ranks)
        return save_checkpoint(
            self.root, state, _Consolidated(self.model, full), tokenizer_from=self.source
        )

    def run(self) -> TrainerResult:
        try:
            return super().run()
        finally:
            _send(self.ranks, STOP)


def _follow(config: TrainerConfig, ranks: Ranks) -> None:
    """Ranks > 0: build the same policy, then obey rank 0's commands until stop."""
    root = Path(config.checkpoint_dir).resolve()
    ckpt = load_latest(root)
    state = ckpt.state if ckpt is not None else TrainerState(source_model=config.model_dir)
    source = ckpt.path if ckpt is not None else Path(config.model_dir)
    policy = build_policy(config, source, state, ranks)
    while True:
        kind, version, payload = _recv(ranks)
        if kind == STOP:
            return
        if kind == STEP:
            batch = _batch(payload, policy.pad_token_id, ranks.device)
            if batch.images is not None:  # rank 0 attached them and sends them next
                batch.pixels = recv_pixels(ranks, ranks.device)
            train_policy(policy, batch, config, ranks)
        elif kind == SAVE:
            save_sharded(root, version, policy, ranks)


def run_sharded_trainer(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    config: TrainerConfig,
    stop_event: threading.Event | None = None,
    *,
    metrics: TrainerMetrics | None = None,
) -> TrainerResult | None:
    """This process's rank of the sharded trainer; rank 0 returns the run's result, others None."""
    torch.set_num_threads(config.torch_threads)
    torch.manual_seed(config.seed)
    ranks = init_ranks(config)
    try:
        if ranks.rank == 0:
            trainer = ShardedTrainer(kafka, topics, config, stop_event=stop_event, metrics=metrics)
            trainer.ranks = ranks
            return trainer.run()
        _follow(config, ranks)
        return None
    finally:
        dist.destroy_process_group()


def leave_rank(status: int) -> NoReturn:
    """End this rank's process with `status`, skipping the interpreter's teardown.

    A gloo process group runs worker threads that `destroy_process_group` does not join (gloo
    has no shutdown; only its destructor joins them). One of them can still be dropping the
    last reference to a finished collective's tensors when the interpreter finalizes; the
    tensor's Python object then wants the GIL, Python ends that thread inside a C++ destructor
    and the process aborts (`terminate called without an active exception`, exit -6), so
    torchrun reports a failed run that had finished (about 1 run in 8 here; the core's stack
    is `~AsyncBroadcastWork` -> `THPVariable_dealloc` -> `take_gil` -> `pthread_exit`).
    Call it once the rank's run has closed what it owns (`run_sharded_trainer` has, when it
    returns: Kafka clients, checkpoint, process groups); what is left is to flush and leave.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)
