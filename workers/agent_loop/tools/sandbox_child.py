"""Sandbox set-up and init, run as pid 1 of fresh namespaces around the untrusted program.

Executed *as a script* (`python -I -S sandbox_child.py SPEC_JSON`) by `sandbox.py` under
`unshare --net --pid --mount --ipc --uts --fork --kill-child --mount-proc` (plus
`--user --map-root-user` when the host is not root). Standard library only; it never imports
the project and never evaluates the program itself: a forked child `execve`s the interpreter.

Steps, each fatal on failure (fail closed: the program never runs half-sandboxed):

1. mounts (as pid 1): make every mount private; read the program from the scratch directory;
   cover `hide` paths with an empty tmpfs (re-exposing the interpreter's install tree
   read-only where it lies under one); mount a size-capped tmpfs owned by the sandbox user
   over the scratch directory and write the program into it; turn the whole tree read-only
   and nosuid (recursively with `mount_setattr`, or a remount per mount point on kernels
   before 5.12); make only the scratch tmpfs writable again;
2. fork; in the child: resource limits (soft = hard, so the program cannot raise them): CPU,
   address space, file size, processes, open files, no core dumps; `nice`;
3. drop privileges (root mode): no supplementary groups, the sandbox gid and uid, then check
   that root cannot be regained; `PR_SET_NO_NEW_PRIVS` (no setuid binaries); re-arm
   `PR_SET_PDEATHSIG` (cleared by the uid change);
4. `chdir(scratch)`, `umask 077`, `execve(argv, env)`.

Pid 1 meanwhile reaps every process (orphans included, so zombies do not eat the process
limit) until the program exits, reports its status and exits; leaving pid 1 makes the kernel
kill everything still running in the sandbox. `--kill-child` kills pid 1 if `unshare` dies.

Status goes to the host on a pipe (`status_fd`), one JSON object per line:
`{"setup_error": "..."}` (then exit 125) or `{"exit_code": n}` (negative: killed by signal).
The program never holds that pipe (close-on-exec), so it cannot forge either.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any

_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in 5.12)
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_SETUP_FAILED = 125

# The interpreter's own symbols include libc; `find_library` would spawn `ldconfig`.
_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    ret = _libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(ret, f"mount {target}")


def _mount_setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> bool:
    """`mount_setattr(2)`; False when the kernel lacks it (ENOSYS)."""
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    ret = _libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if ret != 0 and ctypes.get_errno() == 38:  # ENOSYS
        return False
    _check(ret, f"mount_setattr {path}")
    return True


def _mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) from mountinfo, parents before children."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            points.append((point, set(fields[5].split(","))))
    return sorted(points, key=lambda item: item[0].count("/"))


def _read_only_everywhere(scratch: str) -> None:
    if _mount_setattr("/", _AT_RECURSIVE, _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0):
        _mount_setattr(scratch, 0, 0, _MOUNT_ATTR_RDONLY)
        return
    # Kernels before 5.12: remount each mount point read-only, keeping its locked flags.
    for point, options in _mount_points():
        if point == scratch:
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID
        flags |= _MS_NODEV if "nodev" in options else 0
        flags |= 0x8 if "noexec" in options else 0  # MS_NOEXEC
        _mount(None, point, None, flags)
    _mount(None, scratch, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID)


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _set_up_mounts(spec: dict[str, Any], scratch: str) -> None:
    hide, expose = list(spec["hide"]), list(spec["expose"])
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    script = os.path.join(scratch, spec["script"])
    with open(script, "rb") as handle:
        program = handle.read()
    # Open what must stay visible before covering its parents: bind from the open fd after.
    kept = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in expose}
    for path in hide:
        if os.path.isdir(path) and not _under(scratch, path):
            _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=755")
    for path, fd in kept.items():
        if any(_under(path, hidden) for hidden in hide):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        os.close(fd)
    # The program's only writable place: a size-capped tmpfs over the scratch directory, so
    # nothing it writes ever reaches the host's disk, and its size is bounded.
    uid, gid = spec["owner"]
    options = f"size={int(spec['scratch_bytes'])},nr_inodes=4096,mode=700,uid={uid},gid={gid}"
    _mount("tmpfs", scratch, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(program)
    os.chown(script, uid, gid)
    _read_only_everywhere(scratch)


def _set_limits(limits: dict[str, int]) -> None:
    names = {
        "cpu_s": resource.RLIMIT_CPU,
        "address_space_bytes": resource.RLIMIT_AS,
        "file_size_bytes": resource.RLIMIT_FSIZE,
        "processes": resource.RLIMIT_NPROC,
        "open_files": resource.RLIMIT_NOFILE,
    }
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for key, which in names.items():
        value = int(limits[key])
        # CPU: SIGXCPU at the soft limit, SIGKILL one second later at the hard limit.
        hard = value + 1 if which == resource.RLIMIT_CPU else value
        resource.setrlimit(which, (value, hard))


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        raise OSError("privileges were not dropped")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise OSError("root could be regained after dropping privileges")


def _exec_program(spec: dict[str, Any], scratch: str) -> None:
    """In the forked child: limits, privileges, then become the program (never returns)."""
    _set_limits(spec["limits"])
    if spec["nice"]:
        os.nice(int(spec["nice"]))
    if spec["drop_to"] is not None:
        _drop_privileges(int(spec["drop_to"][0]), int(spec["drop_to"][1]))
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0), "pdeathsig")
    os.chdir(scratch)
    os.umask(0o077)
    argv = list(spec["argv"])
    os.execve(argv[0], argv, dict(spec["env"]))


def _report(status_fd: int, message: dict[str, Any]) -> None:
    os.write(status_fd, (json.dumps(message) + "\n").encode()[:4000])


def _reap_until(pid: int) -> int:
    """As pid 1: reap every child (orphans included) until `pid` exits; its wait status."""
    while True:
        try:
            child, status = os.wait()
        except InterruptedError:
            continue
        if child == pid:
            return status


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = int(spec["status_fd"])
    os.set_inheritable(status_fd, False)
    try:
        scratch = os.path.realpath(spec["scratch"])
        _set_up_mounts(spec, scratch)
        pid = os.fork()
        if pid == 0:
            _exec_program(spec, scratch)
    except BaseException as exc:  # report any set-up failure, then fail closed
        _report(status_fd, {"setup_error": f"{type(exc).__name__}: {exc}"})
        os._exit(_SETUP_FAILED)
    status = _reap_until(pid)
    if os.WIFSIGNALED(status):
        _report(status_fd, {"exit_code": -os.WTERMSIG(status)})
    else:
        _report(status_fd, {"exit_code": os.waitstatus_to_exitcode(status)})
    # Leaving pid 1 makes the kernel kill whatever the program left running.
    os._exit(0)


if __name__ == "__main__":
    main()
