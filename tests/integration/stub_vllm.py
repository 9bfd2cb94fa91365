"""A stand-in for vLLM on a CPU machine, run as `vllm.python` (`--vllm-python`).

As `STUB -c CODE` (the replica's check that the interpreter has vllm) it exits 0. As
`STUB -m vllm.entrypoints.cli.main serve ...` it behaves like a vLLM that holds its GPUs and
takes its time to stop: it ignores SIGTERM, starts one "engine core" child in its own session
(the adapter started it in a new session, as it starts vLLM) that ignores SIGTERM too, writes
both pids and its CUDA_VISIBLE_DEVICES to `$STUB_VLLM_DIR/<pid>.json`. With
`STUB_VLLM_HEALTHY=1` it answers `/health` and `/v1/models` on its `--host/--port` (enough for
the adapter to serve and the replica to register), else it never serves. The test writes it
with this interpreter in its shebang line.
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
    if os.environ.get("STUB_VLLM_HEALTHY") == "1":
        _serve(argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1]))
    while True:
        time.sleep(1)


def _serve(host: str, port: int) -> None:
    from http.server import BaseHTTPRequestHandler, HTTPServer

    bodies = {"/health": {}, "/v1/models": {"data": [{"id": "stub", "max_model_len": 128}]}}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path.split("?")[0] in bodies
            body = json.dumps(bodies.get(self.path.split("?")[0], {})).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    HTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
