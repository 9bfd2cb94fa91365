"""A trainer's side of transfers in a process of its own, for `test_transfer_failures` (-m).

    python -m tests.integration.transfer_sender --address-file F --tensors N --timeout S

Starts a `TransferHub` on a free port (its address written to F), waits for a want, and sends
N tensors of 1 MiB in buckets of 1 MiB to it, again and again, until killed.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

import torch

from workers.weights.hub import TransferHub


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=6.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hub = TransferHub(
        host="127.0.0.1",
        port=0,
        session=uuid.uuid4().hex[:8],
        timeout_s=args.timeout,
        bucket_bytes=1 << 20,
    )
    model = [(f"t{i}", torch.full((256, 1024), float(i))) for i in range(args.tensors)]
    Path(args.address_file).write_text(f"{hub.address} {hub.session}")
    version = 0
    while True:
        wants = hub.pending()
        if wants:
            version += 1
            hub.send(model, version, wants)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
