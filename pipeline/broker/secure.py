"""The local broker with security on: SCRAM-SHA-512 over TLS, ACLs, a CA of its own.

`rollout kafka up --secure` (`start_broker(..., secure=True)`) calls `prepare()` to lay out,
once per data directory:

    <data>/credentials.json   0600  SCRAM passwords of `admin` and of every user, and the
                                    password of the broker's private key
    <data>/tls/ca.pem               the self-signed CA: what clients trust (`ssl_cafile`)
    <data>/tls/broker.pem     0600  encrypted PKCS#8 key + certificate (SAN localhost,
                                    127.0.0.1, ::1) + CA: the broker's PEM keystore
    <data>/server.properties  0600  rendered from infra/kafka/server-secure.properties.template

Then users are created at format time (`StorageTool format --add-scram`, passed through a
0600 Java argument file so no password shows in a process list) or, for a data directory
formatted earlier, through the admin API (`broker.access.ensure_users`).
`broker.access.grant()` adds ACLs; `client_config()` and `config_snippet()` give any stage
its `kafka:` settings.

Invariants:
- Secrets live only in 0600 files under the data directory and in memory; they are never
  logged, never printed by `up`, and `Credentials` has no revealing repr.
- The CA and the broker key are created once; a restart reuses them (clients keep trusting
  the same `ca.pem`). The CA's private key is deleted once the broker certificate is signed.
- Nothing is allowed without an ACL (`allow.everyone.if.no.acl.found=false`); `admin` is
  the only user-facing super user. The controller listener needs the broker's certificate.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import string
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.broker.state import INFRA, BrokerState, rollout_home
from workers.kafka.config import KafkaConfig
from workers.kafka.exceptions import KafkaPlumbingError

__all__ = [
    "ADMIN_USER",
    "Credentials",
    "SecureBrokerError",
    "SecureSetup",
    "check_user",
    "client_config",
    "config_snippet",
    "data_dir_for",
    "load_credentials",
    "prepare",
]

log = logging.getLogger("rollout.kafka.secure")

ADMIN_USER = "admin"
MECHANISM = "SCRAM-SHA-512"
BROKER_PRINCIPAL = "CN=rollout-broker"
PASSWORD_ENV = "ROLLOUT_KAFKA__SASL_PASSWORD"
_USER_CHARS = set(string.ascii_letters + string.digits + "._-")


class SecureBrokerError(KafkaPlumbingError):
    """The secure broker's files are missing or invalid, or a security call was refused."""


@dataclass(frozen=True)
class Credentials:
    """SCRAM passwords by user name (admin included) and the broker key's password."""

    users: dict[str, str] = field(repr=False)
    key_password: str = field(repr=False)

    def __repr__(self) -> str:  # names only, never a password
        return f"Credentials(users={sorted(self.users)})"

    def password(self, user: str) -> str:
        try:
            return self.users[user]
        except KeyError:
            raise SecureBrokerError(f"no credentials for user {user!r}") from None


@dataclass(frozen=True)
class SecureSetup:
    """What `start_broker` needs from `prepare`: no secret is in the repr."""

    data_dir: Path
    properties: Path
    credentials: Credentials
    added_users: tuple[str, ...]

    def scram_format_args(self) -> list[str]:
        """`--add-scram` arguments for StorageTool (secret: put them in an argument file)."""
        args: list[str] = []
        for name, password in sorted(self.credentials.users.items()):
            args += ["--add-scram", f"{MECHANISM}=[name={name},password={password}]"]
        return args

    def admin_config(self, bootstrap: str) -> KafkaConfig:
        return client_config(bootstrap, self.data_dir, ADMIN_USER)


def credentials_path(data_dir: str | Path) -> Path:
    return Path(data_dir) / "credentials.json"


def check_user(name: str) -> str:
    if not name or not set(name) <= _USER_CHARS:
        raise SecureBrokerError(f"user name {name!r}: use letters, digits, '.', '_' and '-'")
    return name


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically with mode 0600 from the first byte."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    tmp.replace(path)


def load_credentials(data_dir: str | Path) -> Credentials:
    path = credentials_path(data_dir)
    try:
        raw = json.loads(path.read_text())
        return Credentials(users=dict(raw["users"]), key_password=str(raw["key_password"]))
    except FileNotFoundError:
        raise SecureBrokerError(f"{path} not found: is this a secure broker's data dir?") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SecureBrokerError(f"{path} is not a valid credentials file") from exc


def ensure_credentials(
    data_dir: Path, users: Iterable[str] = ()
) -> tuple[Credentials, tuple[str, ...]]:
    """Load (or create) the credentials file; add a random password for each new user."""
    wanted = [ADMIN_USER, *(check_user(u) for u in users)]
    path = credentials_path(data_dir)
    creds = (
        load_credentials(data_dir)
        if path.exists()
        else Credentials(users={}, key_password=secrets.token_urlsafe(24))
    )
    added = tuple(dict.fromkeys(u for u in wanted if u not in creds.users))
    if added or not path.exists():
        merged = {**creds.users, **{u: secrets.token_urlsafe(24) for u in added}}
        creds = Credentials(users=merged, key_password=creds.key_password)
        body = {"mechanism": MECHANISM, "users": merged, "key_password": creds.key_password}
        _write_private(path, json.dumps(body, indent=2) + "\n")
        log.info("credentials for %s written to %s", ", ".join(added), path)
    return creds, added


def _openssl(*args: str, env: dict[str, str] | None = None) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise SecureBrokerError("openssl is needed once to create the local CA and broker key")
    result = subprocess.run(
        [openssl, *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if result.returncode != 0:
        raise SecureBrokerError(f"openssl {args[0]} failed: {result.stderr[-2000:]}")


def ensure_tls(data_dir: Path, key_password: str) -> tuple[Path, Path]:
    """Create the CA and the broker's PEM keystore once; return (ca.pem, broker.pem)."""
    tls = data_dir / "tls"
    ca, keystore = tls / "ca.pem", tls / "broker.pem"
    if ca.exists() and keystore.exists():
        return ca, keystore
    tls.mkdir(parents=True, exist_ok=True)
    os.chmod(tls, 0o700)
    work = tls / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(mode=0o700)
    try:
        ca_key, csr, key, crt = (work / n for n in ("ca.key", "broker.csr", "key.pem", "crt.pem"))
        _openssl(
            "req", "-x509",
            "-newkey", "rsa:2048",
            "-nodes",
            "-keyout", str(ca_key),
            "-out", str(ca),
            "-days", "3650",
            "-subj", "/CN=rollout-local-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        _openssl(
            "req",
            "-newkey", "rsa:2048",
            "-nodes",
            "-keyout", str(key),
            "-out", str(csr),
            "-subj", f"/{BROKER_PRINCIPAL}",
        )  # fmt: skip
        ext = work / "ext.cnf"
        ext.write_text(
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            # clientAuth too: the broker presents the same certificate to its controller.
            "extendedKeyUsage=serverAuth,clientAuth\n"
            "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
        )
        _openssl(
            "x509", "-req",
            "-in", str(csr),
            "-CA", str(ca),
            "-CAkey", str(ca_key),
            "-set_serial", "0x" + secrets.token_hex(8),
            "-days", "825",
            "-sha256",
            "-extfile", str(ext),
            "-out", str(crt),
        )  # fmt: skip
        # Kafka's file-based PEM keystore needs an encrypted PKCS#8 key; PBE-SHA1-3DES is
        # the scheme every JDK's EncryptedPrivateKeyInfo can decrypt.
        encrypted = work / "key.p8"
        _openssl(
            "pkcs8", "-topk8",
            "-in", str(key),
            "-v1", "PBE-SHA1-3DES",
            "-passout", "env:ROLLOUT_TLS_KEY_PASSWORD",
            "-out", str(encrypted),
            env={"ROLLOUT_TLS_KEY_PASSWORD": key_password},
        )  # fmt: skip
        _write_private(keystore, encrypted.read_text() + crt.read_text() + ca.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the CA key and the clear broker key go
    log.info("created the local CA %s and the broker keystore %s", ca, keystore)
    return ca, keystore


def prepare(
    data_dir: Path,
    *,
    host: str,
    advertised_host: str,
    port: int,
    controller_port: int,
    users: Sequence[str] = (),
) -> SecureSetup:
    """Credentials, TLS files and the 0600 server.properties of a secure broker."""
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)
    creds, added = ensure_credentials(data_dir, users)
    ca, keystore = ensure_tls(data_dir, creds.key_password)
    template = string.Template((INFRA / "server-secure.properties.template").read_text())
    props = data_dir / "server.properties"
    _write_private(
        props,
        template.substitute(
            host=host,
            advertised_host=advertised_host,
            port=port,
            controller_host="127.0.0.1",
            controller_port=controller_port,
            log_dir=data_dir / "logs",
            admin_user=ADMIN_USER,
            admin_password=creds.password(ADMIN_USER),
            keystore=keystore,
            key_password=creds.key_password,
            truststore=ca,
            broker_principal=BROKER_PRINCIPAL,
        ),
    )
    return SecureSetup(data_dir, props, creds, added)


@contextmanager
def java_argfile(data_dir: Path, args: Sequence[str]) -> Iterator[str]:
    """A 0600 Java launcher argument file (`java @file`) holding `args`, removed after use.

    Keeps secrets such as `--add-scram` passwords out of /proc/<pid>/cmdline.
    """
    path = data_dir / f".java-args-{secrets.token_hex(4)}"
    quoted = ['"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"' for a in args]
    _write_private(path, "\n".join(quoted) + "\n")
    try:
        yield f"@{path}"
    finally:
        path.unlink(missing_ok=True)


def data_dir_for(port: int, data_dir: str | Path | None = None) -> Path:
    """The data dir of the secure broker on `port`: given, recorded by `up`, or the default."""
    if data_dir:
        return Path(data_dir).expanduser().resolve()
    state = BrokerState.load(port)
    if state is not None and state.data_dir:
        return Path(state.data_dir)
    return (rollout_home() / f"kafka-{port}").resolve()


def client_config(bootstrap: str, data_dir: str | Path, user: str, **extra: object) -> KafkaConfig:
    """A `KafkaConfig` for `user` of the secure broker whose data dir is `data_dir`."""
    creds = load_credentials(data_dir)
    return KafkaConfig(
        bootstrap_servers=bootstrap,
        security_protocol="SASL_SSL",
        sasl_mechanism=MECHANISM,
        sasl_username=user,
        sasl_password=creds.password(user),
        ssl_cafile=str(Path(data_dir).resolve() / "tls" / "ca.pem"),
        **extra,  # type: ignore[arg-type]
    )


def config_snippet(bootstrap: str, data_dir: str | Path, user: str, *, port: int) -> str:
    """The `kafka:` section of a run config for `user`, password left to the environment."""
    load_credentials(data_dir).password(user)  # the user must exist
    section = {
        "kafka": {
            "bootstrap_servers": [bootstrap],
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": MECHANISM,
            "sasl_username": user,
            "ssl_cafile": str(Path(data_dir).resolve() / "tls" / "ca.pem"),
        }
    }
    header = (
        f"# Kafka settings for user {user!r} of the local secure broker at {bootstrap}.\n"
        f"# The password is not written here; put it in the environment of every stage:\n"
        f'#   export {PASSWORD_ENV}="$(rollout kafka creds --port {port} --user {user} '
        f'--password)"\n'
    )
    return header + yaml.safe_dump(section, sort_keys=False)
