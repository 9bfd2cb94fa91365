"""Who may do what on the local secure broker, through the admin API: SCRAM users, ACLs.

- `ensure_users` creates (or resets to the stored password) users' SCRAM credentials;
  `rollout kafka up --secure --user NAME` and `rollout kafka creds --add` call it.
- `grant` adds ALLOW ACLs for a user on topics (literal names or prefixes) and on a consumer
  group, and returns only once the broker applies them.

The credentials, the TLS files and the broker's configuration are `pipeline.broker.secure`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

from pipeline.broker.secure import Credentials, SecureBrokerError, check_user
from workers.kafka.config import KafkaConfig

__all__ = ["Operation", "ensure_users", "grant"]

log = logging.getLogger("rollout.kafka.secure")

Operation = Literal["read", "write", "describe", "create", "delete", "alter", "describe_configs"]


def ensure_users(admin: KafkaConfig, credentials: Credentials, users: Sequence[str]) -> None:
    """Create (or reset to the stored password) the SCRAM credentials of `users`."""
    if not users:
        return
    from kafka.admin import ScramMechanism, UserScramCredentialUpsertion
    from kafka.errors import KafkaError

    from workers.kafka.clients import make_admin

    upserts = [
        UserScramCredentialUpsertion(u, ScramMechanism.SCRAM_SHA_512, credentials.password(u))
        for u in users
    ]
    client = make_admin(admin)
    try:
        result = client.alter_user_scram_credentials(upserts)
    except KafkaError as exc:
        raise SecureBrokerError(f"creating SCRAM users failed: {exc}") from exc
    finally:
        client.close()
    failed = {u: err for u, err in (result or {}).items() if err}
    if failed:
        raise SecureBrokerError(f"creating SCRAM users failed: {failed}")
    log.info("SCRAM users created: %s", ", ".join(users))


def grant(
    admin: KafkaConfig,
    user: str,
    *,
    topics: Sequence[str] = (),
    operations: Sequence[Operation] = ("read", "write", "describe"),
    group: str | None = None,
    prefixed: bool = False,
    wait_s: float = 15.0,
) -> int:
    """Allow `user` the `operations` on each of `topics`, and READ on consumer `group`.

    `prefixed=True` makes every name a prefix (`rl.` covers all the pipeline's topics, a
    group prefix covers every group starting with it). Granting is idempotent. Producers
    need `write` (idempotent producers too: WRITE on a topic implies IDEMPOTENT_WRITE);
    consumers need `read` on the topic and on their group. Returns the number of ACLs.

    The controller commits ACLs before the broker's authorizer applies them; `grant` returns
    only once the broker describes all of them (up to `wait_s`), so the next request of
    `user` is already allowed.
    """
    from kafka.admin import (
        ACL,
        ACLFilter,
        ACLOperation,
        ACLPermissionType,
        ACLResourcePatternType,
        ResourcePattern,
        ResourcePatternFilter,
        ResourceType,
    )
    from kafka.errors import KafkaError

    from workers.kafka.clients import make_admin

    pattern = ACLResourcePatternType.PREFIXED if prefixed else ACLResourcePatternType.LITERAL
    principal = f"User:{check_user(user)}"

    def acl(resource: ResourceType, name: str, op: str) -> ACL:
        return ACL(
            principal,
            "*",
            ACLOperation[op.upper()],
            ACLPermissionType.ALLOW,
            ResourcePattern(resource, name, pattern),
        )

    acls = [acl(ResourceType.TOPIC, t, op) for t in topics for op in operations]
    if group is not None:
        acls.append(acl(ResourceType.GROUP, group, "read"))
    if not acls:
        return 0
    anything = ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY)
    mine = ACLFilter(principal, None, ACLOperation.ANY, ACLPermissionType.ANY, anything)
    client = make_admin(admin)
    try:
        result = client.create_acls(acls)
        failed = result.get("failed") or []
        if failed:
            raise SecureBrokerError(f"granting ACLs to {principal} failed: {failed}")
        deadline = time.monotonic() + wait_s
        while True:
            present, _ = client.describe_acls(mine)
            if {_acl_key(a) for a in acls} <= {_acl_key(a) for a in present}:
                break
            if time.monotonic() > deadline:
                raise SecureBrokerError(f"ACLs of {principal} not applied within {wait_s:.0f}s")
            time.sleep(0.1)
    except KafkaError as exc:
        raise SecureBrokerError(f"granting ACLs to {principal} failed: {exc}") from exc
    finally:
        client.close()
    log.info(
        "granted %s on topics %s group %s to %s", list(operations), list(topics), group, principal
    )
    return len(acls)


def _acl_key(acl: Any) -> tuple[object, ...]:
    pattern = acl.resource_pattern
    return (
        acl.principal,
        acl.operation,
        acl.permission_type,
        pattern.resource_type,
        pattern.resource_name,
        pattern.pattern_type,
    )
