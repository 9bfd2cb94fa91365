"""The receiving side of broadcast weights (`weights.mode: broadcast`).

Two parts, one per process (`workers.weights.protocol` has the rendezvous):

- `GrantClient`, in a replica's sync controller: connects to the trainer's store announced on
  `rl.policy`, keeps one want standing for its replica (the version it serves, its receiving
  ranks), and returns the grant that answers it. The controller then posts the grant to its
  replica (`POST /update_weights {"version", "transfer": grant}`) and, once that returns, a
  new want: so at the trainer's next version the replica is already waiting.
- `receive_checked(grant, live)`, in an `hf` replica: receives the granted transfer and checks
  it against the served model like a checkpoint (`weights.check_state`), raising
  `WeightLoadError` for tensors that do not fit and `WeightTransferError` when they did not
  arrive. (A vLLM replica receives in its workers: `vllm_worker.WeightSync`.)
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from schemas.events import WeightTransfer
from workers.weights.exceptions import WeightLoadError, WeightTransferError
from workers.weights.protocol import MEMBERS, Grant, Want, grant_key, want_key

if TYPE_CHECKING:
    import torch

__all__ = ["GrantClient", "receive_checked"]

log = logging.getLogger("rollout.replica.weight_receiver")

CONNECT_TIMEOUT_S = 10.0


def receive_checked(
    grant: dict[str, Any], live: dict[str, torch.Tensor], pool: list[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The granted weights, checked against the model's tensors `live` (module docstring);
    `pool`: the replica's receive buffers, kept from one transfer to the next."""
    from workers.weights.load import check_state
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


class GrantClient:
    """One controller's standing want at the trainer's store (module docstring)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self._at: WeightTransfer | None = None
        self._store: Any = None
        self._want: Want | None = None

    def connect(self, transfer: WeightTransfer) -> None:
        """Talk to the store `transfer` announces (reconnects when the trainer changed)."""
        if self._store is not None and self._at == transfer:
            return
        import torch.distributed as dist

        from workers.weights.group import store_client

        self.close()
        client = store_client(transfer.address, CONNECT_TIMEOUT_S)
        self._store = dist.PrefixStore(transfer.session + "/", client)
        self._at = transfer
        log.info("replica %s: weights from %s (session %s)", self.replica, *self._key())

    def _key(self) -> tuple[str, str]:
        assert self._at is not None
        return self._at.address, self._at.session

    def want(
        self,
        version: int,
        ranks: int,
        dtype: str | None = None,
        backends: tuple[str, ...] = ("gloo",),
    ) -> None:
        """Keep a want standing for a replica serving `version` (-1: none of the trainer's)
        in `dtype`, whose `ranks` processes receive over one of `backends`."""
        fresh = (version, ranks, dtype, tuple(backends))
        if self._want is not None and (
            (self._want.version, self._want.ranks, self._want.dtype, self._want.backends) == fresh
        ):
            return
        first = self._want is None
        self._want = Want(self.replica, uuid.uuid4().hex, version, ranks, dtype, tuple(backends))
        self._store.set(want_key(self.replica), self._want.dumps())
        if first:
            self._store.append(MEMBERS, self.replica + "\n")

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """The grant answering the standing want, if it comes within `timeout_s`."""
        import torch.distributed as dist

        if self._want is None:
            return None
        key = grant_key(self._want.nonce)
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except dist.DistStoreError:  # not yet (a timeout): the want stays
            return None
        raw = self._store.get(key)
        self._store.delete_key(key)
        nonce, self._want = self._want.nonce, None  # granted: the next want is a new one
        try:
            return Grant.loads(raw).as_dict()
        except ValueError as exc:
            log.error("replica %s: unreadable grant for want %s: %s", self.replica, nonce, exc)
            return None

    def close(self) -> None:
        self._store, self._at, self._want = None, None, None
