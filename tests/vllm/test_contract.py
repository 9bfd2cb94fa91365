"""The seven replica-contract tests of tests/gpu/test_replica_contract.py, on a CPU vLLM replica.

The tests are the same functions (imported, so they are collected here under marker `vllm`);
`replica_url` from tests/vllm/conftest.py points them at the session's tied-embedding replica.
"""

from __future__ import annotations

import pytest

from tests.gpu.test_replica_contract import (  # noqa: F401  (collected by pytest)
    _replica,
    test_abort_returns_partial_generation,
    test_completion_returns_tokens_logprobs_and_version,
    test_metrics_expose_prefix_cache_counters,
    test_pause_aborts_in_flight_and_resume_serves_held_requests,
    test_prompt_past_context_is_a_4xx,
    test_stop_token_finishes_with_stop,
    test_update_weights_changes_the_version,
)

pytestmark = pytest.mark.vllm
