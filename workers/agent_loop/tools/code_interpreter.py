"""A code-interpreter tool: runs the model's Python program in the sandbox of `sandbox.py`.

`code_interpreter(code)` runs `code` as a fresh program (no state carries over between
calls) and answers with its stdout, its stderr, and a status line when it did not exit 0:

    <stdout>
    [stderr]
    <stderr>
    [exit status 1]                       or  [killed: wall-time limit of 10 s]
    [output truncated at 65536 bytes]

The program's failures (exceptions, non-zero exit, limits hit) are *results*, not errors: the
model sees them and can react. `ToolArgumentError` is raised for a missing or oversized
`code` argument; `SandboxError` (not a `ToolError`) when the sandbox itself cannot start.

Config (the YAML entry's `config:`): `max_code_chars` plus every field of `SandboxConfig`
(`limits: {wall_time_s, cpu_time_s, memory_mb, ...}`, `mode`, `hide_paths`, ...).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from workers.agent_loop.exceptions import ToolArgumentError
from workers.agent_loop.tools.base import (
    BaseTool,
    FunctionSchema,
    ToolResult,
    ToolSchema,
    validation_summary,
)
from workers.agent_loop.tools.sandbox import Sandbox, SandboxConfig, SandboxResult

__all__ = ["CodeInterpreterTool", "format_result"]

logger = logging.getLogger("rollout.tools")

_SIGNALS = {
    signal.SIGKILL: "killed",
    signal.SIGXCPU: "CPU-time limit exceeded",
    signal.SIGXFSZ: "file-size limit exceeded",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGABRT: "aborted",
}


def format_result(result: SandboxResult, config: SandboxConfig) -> str:
    """The tool response text for one run (see the module docstring)."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts += ["[stderr]", result.stderr.rstrip("\n")]
    if result.timed_out:
        parts.append(f"[killed: wall-time limit of {config.limits.wall_time_s:g} s]")
    elif result.output_truncated:
        parts.append(f"[output truncated at {config.limits.max_output_bytes} bytes; killed]")
    elif result.exit_code < 0:
        number = -result.exit_code
        try:
            reason = _SIGNALS.get(signal.Signals(number), signal.Signals(number).name)
        except ValueError:
            reason = f"signal {number}"
        parts.append(f"[terminated: {reason}]")
    elif result.exit_code != 0:
        parts.append(f"[exit status {result.exit_code}]")
    if not parts:
        parts.append("[no output]")
    return "\n".join(parts)


class CodeInterpreterTool(BaseTool):
    """Runs Python code in a sandbox; one `Sandbox` (and its concurrency gate) per tool."""

    default_schema = ToolSchema(
        function=FunctionSchema(
            name="code_interpreter",
            description=(
                "Run a Python 3 program and return what it prints (stdout and stderr). "
                "Each call starts a fresh process with only the standard library, no network "
                "and a time limit; print the values you need."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "The Python program to run."}
                },
                "required": ["code"],
            },
        )
    )

    def setup(self) -> None:
        options = dict(self.config)
        self.max_code_chars = int(options.pop("max_code_chars", 100_000))
        try:
            self.sandbox_config = SandboxConfig.model_validate(options)
        except ValidationError as exc:
            raise ValueError(f"invalid code interpreter config: {validation_summary(exc)}") from exc
        self._sandbox: Sandbox | None = None

    @property
    def sandbox(self) -> Sandbox:
        # Created on first use, inside the event loop that will run it.
        if self._sandbox is None:
            self._sandbox = Sandbox(self.sandbox_config)
        return self._sandbox

    async def execute(self, instance_id: str | None, parameters: Mapping[str, Any]) -> ToolResult:
        code = parameters.get("code") if isinstance(parameters, Mapping) else None
        if not isinstance(code, str):
            raise ToolArgumentError(
                "code_interpreter needs a string argument 'code'", tool=self.name
            )
        if len(code) > self.max_code_chars:
            raise ToolArgumentError(
                f"the code is longer than {self.max_code_chars} characters", tool=self.name
            )
        result = await self.sandbox.run_python(code)
        metrics = {
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "output_truncated": result.output_truncated,
            "duration_s": round(result.duration_s, 4),
        }
        return ToolResult(text=format_result(result, self.sandbox_config), metrics=metrics)
