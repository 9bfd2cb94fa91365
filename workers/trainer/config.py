"""`TrainerConfig`: everything the off-policy trainer is configured by, and nothing else.

Imports no torch (the CLI parses it before anything heavy loads). Names of the loss knobs
follow verl: `clip_ratio_low`/`clip_ratio_high` (PPO clip ε), `clip_ratio_c` (dual clip),
`rollout_is_threshold` (the truncation cap C of the behaviour importance weights),
`rollout_is_level` (token | sequence | geometric), `kl_coef`/`kl_loss_type` (KL to a frozen
reference policy), `loss_agg_mode`; `ppo_mini_batches` and `ppo_epochs` (verl's
`ppo_mini_batch_size` and `ppo_epochs`, counted in mini-batches per step). See
`workers.trainer.loss` for the exact formula and `workers.trainer.step` for the updates: the
loss knobs bear the names of `policy_loss`'s keyword arguments, and the step passes every
field of such a name to it.

Cross-field rules checked at start:
- with `stale_policy='drop'`, `max_staleness >= sync_every - 1`: replicas only see every
  `sync_every`-th version, so a smaller bound would drop every group;
- `keep_checkpoints >= 2`: a replica may still be loading the previous checkpoint while the
  next one is written, so the one before the newest is never deleted;
- with the run's `weights.mode='broadcast'`, `nproc` 1 only (checked by the run's config:
  rank 0 would first have to gather the sharded weights every sync).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.stale import StalePolicy
from workers.media.config import MediaConfig

__all__ = [
    "LENT_REPLICA_PREFIX",
    "ISLevel",
    "KLLossType",
    "LendConfig",
    "LossAggMode",
    "Precision",
    "RouterReplayMode",
    "StalePolicy",
    "TrainerConfig",
]

ISLevel = Literal["token", "sequence", "geometric"]
KLLossType = Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
Precision = Literal["fp32", "bf16"]
RouterReplayMode = Literal["off", "r3"]


#: The id of a lent trainer's replica on `rl.replicas` is this, `-<port>` (`rollout status`).
LENT_REPLICA_PREFIX = "trainer-lent"


class LendConfig(BaseModel):
    """Hybrid lending (`workers.trainer.lend`): while the trainer waits for groups, its own
    model serves generation as a replica on `rl.replicas`; it withdraws once
    `reclaim_ratio * train_batch_size` groups are ready (verl's `switch_threshold_ratio`)."""

    model_config = ConfigDict(extra="forbid")

    enable: bool = Field(default=False, description="Lend the idle trainer to generation.")
    reclaim_ratio: float = Field(
        default=0.75,
        gt=0,
        le=1.0,
        description="Withdraw (and train once the batch is whole) when this share of "
        "`train_batch_size` groups is ready; 1.0 lends until the batch is complete.",
    )
    host: str = Field(default="127.0.0.1", description="Address the lent replica listens on.")
    port: int = Field(default=0, ge=0, le=65535, description="Its port; 0 picks a free one.")
    advertise: str = Field(
        default="",
        description="URL announced on `rl.replicas` (another node's routers reach it there); "
        "empty: http://host:port, the node's routable address when host is 0.0.0.0 (`rollout "
        "up --ray` sets both). A loopback URL is refused in a run that spans nodes.",
    )
    # As large as a standalone `hf` replica (`replica serve --max-batch`, 64): the routers'
    # `load` routing shares requests in proportion to the capacities the replicas report, so
    # at 16 the lent engine drew a fifth of a batch beside one replica (issue 30), however fast.
    max_batch: int = Field(
        default=64,
        ge=1,
        le=1024,
        description="Sequences it runs at once; also the capacity it reports, by which the "
        "routers (`routing: load`) share requests between it and the replicas.",
    )


class TrainerConfig(BaseModel):
    """The off-policy trainer: model, optimisation, loss, staleness, checkpoints, Kafka group."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str = Field(
        default="",
        description="HF model directory the replicas serve (weights, config, tokenizer); "
        "ignored on restart when `checkpoint_dir` holds a checkpoint.",
    )
    media: MediaConfig = Field(
        default_factory=MediaConfig,
        exclude=True,
        description="Derived from the run's `media`: the store the samples' images are read "
        "from (vision-language policies, `workers.trainer.images`).",
    )
    checkpoint_dir: str = Field(
        default="checkpoints",
        min_length=1,
        description="Shared storage for `step-N/` checkpoints and the `latest` pointer; "
        "default in a run: `runs/<run>/checkpoints` (`<run>`: `topics.prefix` without its "
        "trailing dot; `rollout up`: `<run dir>/checkpoints`), so runs never resume each "
        "other's checkpoints.",
    )
    keep_checkpoints: int = Field(
        default=3, ge=2, le=1000, description="Newest checkpoints kept; older ones are deleted."
    )
    metrics_file: str | None = Field(
        default=None,
        description="JSON-lines log of every step (metrics + trajectory ids); "
        "default: `<checkpoint_dir>/metrics.jsonl`.",
    )
    group_id: str = Field(
        default="trainer",
        min_length=1,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Consumer group on the replay topic (offsets committed for monitoring; "
        "the checkpoint's offsets are the truth on restart); default in a run: "
        "`{topics.prefix}trainer`.",
    )
    train_batch_size: int = Field(
        default=8,
        ge=1,
        le=65536,
        description="Groups per step; the agent-loop's admission gate counts in these batches.",
    )
    micro_batch_size: int = Field(
        default=8,
        ge=1,
        le=65536,
        description="Samples per forward/backward (grad accumulation); unused when "
        "`max_tokens_per_micro_batch` is set.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        le=16_777_216,
        description="Token budget of a micro-batch (prompt + response tokens, as verl's "
        "ppo_max_token_len_per_gpu): samples placed first-fit-decreasing, so micro-batches "
        "are full; a longer sample trains alone. None: `micro_batch_size` samples each.",
    )
    packed: bool = Field(
        default=True,
        description="Forwards on the micro-batch's sequences concatenated without padding "
        "(attention kept inside each sequence, `workers.trainer.attention`); false: the "
        "padded layout of the wire, the reference the packed one is tested against.",
    )
    logprob_chunk_tokens: int | None = Field(
        default=1024,
        ge=1,
        le=1_048_576,
        description="Logprobs and entropy from the last hidden state in chunks of this many "
        "tokens (recomputed in the backward), never the [tokens, vocabulary] fp32 logits; "
        "None: all at once (the reference).",
    )
    lr: float = Field(default=1e-4, gt=0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, le=1.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="Clip the global gradient norm; None: no clipping."
    )
    clip_ratio_low: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip ε below 1 (ratio ≥ 1 − ε_low)."
    )
    clip_ratio_high: float = Field(
        default=0.2, gt=0, le=10, description="PPO clip ε above 1 (ratio ≤ 1 + ε_high; DAPO 0.28)."
    )
    rollout_is_threshold: float = Field(
        default=2.0,
        ge=1.0,
        le=1e6,
        description="Cap C of the truncated behaviour importance weights min(w, C).",
    )
    rollout_is_level: ISLevel = Field(
        default="token",
        description="token: per-token w; sequence: product over the response; "
        "geometric: exp of the mean log-ratio.",
    )
    clip_ratio_c: float | None = Field(
        default=None,
        gt=1.0,
        le=100.0,
        description="Dual-clip bound c: with A < 0 the loss is at most −A·c (verl 3.0); None: off.",
    )
    entropy_coeff: float = Field(
        default=0.0, ge=0, le=1.0, description="Entropy bonus weight (0: entropy only logged)."
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        le=100.0,
        description="Weight of KL(π_θ ‖ π_ref) in the loss, π_ref the frozen starting model "
        "(`model_dir`); 0: no reference model is loaded.",
    )
    kl_loss_type: KLLossType = Field(
        default="k3",
        description="KL estimator: k1 (kl), k2 (mse) or k3 (low_var_kl), verl's names in brackets.",
    )
    loss_agg_mode: LossAggMode = Field(
        default="token-mean",
        description="How per-token losses become one number (verl's loss_agg_mode).",
    )
    loss_norm_length: int | None = Field(
        default=None,
        ge=1,
        description="T of seq-mean-token-sum-norm (e.g. the max response length); "
        "None: the padded response length of the update.",
    )
    ppo_mini_batches: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Optimiser updates per epoch of a step: its groups are cut into this many "
        "mini-batches (whole groups each). More than one lets the PPO clip act.",
    )
    ppo_epochs: int = Field(
        default=1, ge=1, le=100, description="Passes over the step's mini-batches."
    )
    mask_truncated: bool = Field(
        default=False,
        description="Leave responses cut at their token budget (finish_reason 'length') out "
        "of the loss (DAPO's overlong filtering).",
    )
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="Largest staleness trained (`schemas.stale.staleness` of the trainer's "
        "version and a group's min_global_steps); None: unbounded. The run's one bound: the "
        "replay stage drops at it too, and the admission gate admits within it less "
        "agent_loop.admission.margin.",
    )
    stale_policy: StalePolicy = Field(
        default="drop", description="Too-old groups: drop (to the stale topic) or keep (train)."
    )
    sync_every: int = Field(
        default=1, ge=1, le=100_000, description="Steps between checkpoint + PolicyVersion."
    )
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this global step; None: run until stopped."
    )
    idle_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Stop (cleanly, with a final checkpoint) after this long without input.",
    )
    poll_timeout_s: float = Field(
        default=0.5, gt=0, le=60, description="How long one poll of the replay topic waits."
    )
    dedup_window: int = Field(
        default=100_000,
        ge=0,
        le=10_000_000,
        description="Recently trained groups remembered (in checkpoints) to skip redeliveries.",
    )
    torch_threads: int = Field(default=2, ge=1, le=256, description="torch intra-op threads.")
    precision: Precision = Field(
        default="fp32",
        description="fp32: every op in fp32. bf16: forward and backward under bf16 autocast "
        "(weights, gradients and AdamW stay fp32): on a GPU, less activation memory and faster "
        "matmuls, at the price of logprobs a little further from the rollout's.",
    )
    router_replay: RouterReplayMode = Field(
        default="off",
        description="Mixture-of-Experts policies. r3: every MoE layer of the training forward "
        "uses the experts the rollout recorded for each token (gate weights from the live "
        "router logits, so the routers still learn; positions not recorded are routed live). "
        "off: routed live, and the step log's router_mismatch_rate says on what share of "
        "recorded (response token, layer) rows the trainer's top-k differs from the "
        "rollout's. r3 on a dense model is refused at start.",
    )
    device: str = Field(
        default="cpu",
        pattern=r"^(cpu|auto|cuda(:[0-9]+)?)$",
        description="Where the policy trains: cpu, cuda, cuda:N, or auto (cuda when one is "
        "visible, else the CPU). The launchers (`rollout up`, local and Ray) give the trainer "
        "its own GPU, one a rank, from what the replicas leave (none: it sees none, and auto "
        "trains on the CPU). Checkpoints are written from any device.",
    )
    seed: int = Field(default=0, ge=0, description="torch seed at start.")
    nproc: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Trainer processes (ranks) on this node: 1 trains in one process as always; "
        "N > 1 launches N ranks through torchrun with the policy sharded by FSDP2 (gloo on "
        "cpu, nccl with one GPU per rank on cuda). Under torchrun (WORLD_SIZE set) the "
        "launcher's world size is used instead.",
    )

    lend: LendConfig = Field(
        default_factory=LendConfig,
        description="Hybrid mode: the idle trainer serves generation (`LendConfig`).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.lend.enable and self.nproc > 1:
            raise ValueError(
                f"trainer.lend needs nproc=1, not {self.nproc}: a sharded (FSDP2) policy "
                "forwards only with every rank at once, so one rank cannot serve it alone"
            )
        if (
            self.max_staleness is not None
            and self.stale_policy == "drop"
            and self.max_staleness < self.sync_every - 1
        ):
            raise ValueError(
                f"max_staleness={self.max_staleness} < sync_every-1={self.sync_every - 1}: "
                "replicas see every sync_every-th version, so every group would be dropped"
            )
        return self

    @property
    def metrics_path(self) -> str:
        return self.metrics_file or f"{self.checkpoint_dir.rstrip('/')}/metrics.jsonl"
