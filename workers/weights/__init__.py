"""Weights from the trainer to the replicas over torch.distributed, without a shared disk.

Kafka stays the control plane: the trainer announces on `rl.policy` (`PolicyVersion.transfer`)
where its rendezvous store listens and which session it runs; the bytes travel over a process
group formed for one transfer. The pieces, lowest first:

    buckets.py    tensors → flat byte buckets of a bounded size and back (the manifest)
    group.py      a store client, a gloo (or NCCL) process group built straight from it, the
                  NCCL settings that make it raise instead of hang or end the process
    receive.py    one receiver's side of a transfer, from its grant (torch and stdlib only:
                  it also runs inside vLLM's worker processes, in vLLM's environment)
    protocol.py   the rendezvous: store keys, wants and grants (stdlib only)
    send.py       the trainer's side of one replica's transfer, and the lanes it sends from
    hub.py        the trainer's side: the store, who gets the next transfer, the sends
    config.py     `WeightsConfig` (no torch)

Importing this package imports nothing.
"""
