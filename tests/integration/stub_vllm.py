"""A stand-in for vLLM on a CPU machine, run as `vllm.python` (`--vllm-python`).

As `STUB -c CODE` (the replica's check that the interpreter has vllm) it exits 0. As
`STUB -m vllm.entrypoints.cli.main serve ...` it behaves like a vLLM that holds its GPUs and
takes its time to stop: it ignores SIGTERM, starts one "engine core" child in its own session
(the adapter started it in a new session, as it starts vLLM) that ignores SIGTERM too, writes
both pids and its CUDA_VISIBLE_DEVICES to `$STUB_VLLM_DIR/<pid>.json`, and never serves.
The test writes it with this interpreter in its shebang line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if argv[:1] == ["-c"]:
        return 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    core = subprocess.Popen(  # inherits SIG_IGN for SIGTERM
        [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]
    )
    record = {
        "pid": os.getpid(),
        "core": core.pid,
        "sid": os.getsid(0),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "argv": argv,
    }
    out = Path(os.environ["STUB_VLLM_DIR"]) / f"{os.getpid()}.json"
    out.write_text(json.dumps(record))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
