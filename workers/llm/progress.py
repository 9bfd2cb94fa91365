"""What one generation has so far, over all its pieces: the LLM client's accumulation rules.

Pure logic, no I/O (`workers.llm.client` drives it; its module docstring has the whole
contract). A piece that made progress (tokens, or a real finish) contributes its tokens and
logprobs in order and its policy version; with routing asked for, the first such piece's
routing is kept and each later piece adds only the positions past it
(`RoutedExperts.extended_by`): a position keeps the routing of the weights that first fed it,
whatever a newer version computes for it when a resumed request re-feeds it.

A piece's routing covers every position it fed from 0, its context (prompt + tokens so far)
and its own tokens but the last (never fed): `routing_problem` names a piece that breaks that.
"""

from __future__ import annotations

from schemas.routing import RoutedExperts
from workers.llm.contract import CompletionChoice, GenerateOutput
from workers.llm.exceptions import RetriesExhaustedError

__all__ = ["Progress", "routing_problem"]


class Progress:
    """What one generation has so far (mutable, private to one `generate` call)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # of pieces that produced tokens
        self.last_version: int | None = None
        self.replicas: list[str] = []
        self.pieces = 0
        self.routing: RoutedExperts | None = None  # append-only over the pieces

    def add(
        self, choice: CompletionChoice, version: int, logprobs: list[float], *, routed: bool
    ) -> None:
        """Take a piece that made progress: its tokens and `logprobs` after those so far, its
        `version` if it produced tokens, and (`routed`) its routing past the positions held."""
        self.tokens.extend(choice.token_ids)
        self.logprobs.extend(logprobs)
        if choice.token_ids:
            self.versions.append(version)
        if routed:
            if choice.routed_experts is None:
                raise ValueError("a routed piece carries no routing (see `routing_problem`)")
            piece = choice.routed_experts
            self.routing = piece if self.routing is None else self.routing.extended_by(piece)

    def output(self, finish: str) -> GenerateOutput:
        vs = self.versions or ([self.last_version] if self.last_version is not None else [0])
        return GenerateOutput(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            min_global_steps=min(vs),
            max_global_steps=max(vs),
            pieces=self.pieces,
            replicas=self.replicas,
            routed_experts=self.routing,
        )

    def exhausted(self, message: str, *, last_error: BaseException | None) -> RetriesExhaustedError:
        """The error that ends this generation's retries, carrying what it has so far."""
        return RetriesExhaustedError(message, last_error=last_error, partial=self.output("abort"))


def routing_problem(choice: CompletionChoice, context: int, expected: bool) -> str | None:
    """Why a piece's routing breaks the contract (module docstring), or None."""
    if not expected:
        return None
    routing = choice.routed_experts
    want = context + len(choice.token_ids) - 1
    if routing is None:
        return "no routed_experts although they were asked for"
    if routing.tokens != want:
        return f"routed_experts cover {routing.tokens} positions, not context + tokens - 1 = {want}"
    return None
