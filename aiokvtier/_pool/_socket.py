"""The pool's Unix socket: a lock that says who serves a path, the listening socket, file descriptors
passed with SCM_RIGHTS, and clear errors for a connection that cannot be made.

The owner takes an exclusive ``flock`` on ``PATH.lock`` before it binds: the
kernel drops the lock when the owner dies, so a socket file left behind by a
dead owner is known to be stale (and replaced), and a second owner on the
same path is refused while the first lives. The socket is bound, made
``mode`` (0600 by default), and only then listened on, so nobody can
connect before the mode holds.

asyncio (and uvloop) have no ``recvmsg``/``sendmsg`` for ancillary data: the
two calls here wait for readiness with ``add_reader``/``add_writer`` and
then make the call on the non-blocking socket.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import socket
import stat

from .._errors import PoolError
from . import _wire

__all__ = ["Listener", "connect", "recv_frame_with_fds", "send_with_fds"]


class Listener:
    """The owner's side of a path: the lock and the listening socket (made on a worker thread)."""

    def __init__(self, path: str, mode: int) -> None:
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise PoolError(f"cannot serve a pool at {path}: the directory {directory} does not exist")
        self._lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self._lock, 32, 0).decode(errors="replace").strip() or "unknown"
                raise PoolError(f"a pool is already served at {path} (owner pid {holder})") from None
            os.ftruncate(self._lock, 0)
            os.pwrite(self._lock, f"{os.getpid()}\n".encode(), 0)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)  # a dead owner's: the lock was free
                else:
                    raise PoolError(f"cannot serve a pool at {path}: something that is not a socket is there")
            except FileNotFoundError:
                pass
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                self.sock.bind(path)
                os.chmod(path, mode)
                self.sock.listen(256)
                self.sock.setblocking(False)
            except BaseException:
                self.sock.close()
                _unlink(path)
                raise
        except BaseException:
            os.close(self._lock)
            raise

    def close(self) -> None:
        """Stop listening, remove the socket file, then drop the lock (in that order: a new owner
        that gets the lock finds no socket of ours to remove)."""
        try:
            self.sock.close()
            _unlink(self.path)
        finally:
            os.close(self._lock)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def connect(path: str) -> socket.socket:
    """A non-blocking socket connected to the pool at ``path``.

    :raises PoolError: no socket there, permission denied, or nobody accepts (the owner died).
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, path)
    except FileNotFoundError:
        sock.close()
        raise PoolError(f"no pool at {path}: the socket does not exist (is the owner running?)") from None
    except PermissionError:
        sock.close()
        raise PoolError(_denied(path)) from None
    except ConnectionRefusedError:
        sock.close()
        # A directory or a regular file refuses a connection as a dead owner's socket does.
        other = await asyncio.to_thread(_not_a_socket, path)
        raise PoolError(
            other
            or f"the pool at {path} refused the connection: its owner is gone (a restarted owner replaces the socket)"
        ) from None
    except OSError as exc:
        sock.close()
        raise PoolError(f"cannot connect to the pool at {path}: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _not_a_socket(path: str) -> str | None:
    """What is at ``path`` when it is not a socket, said as an error; None for a socket (or nothing)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a name in the abstract namespace (a leading NUL) is no file
        return None
    if stat.S_ISSOCK(mode):
        return None
    kind = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"
    return (
        f"{path} is {kind}, not a pool's socket: attach to the path 'aiokvtier pool --socket' "
        "(or Pool(config, path)) serves"
    )


def _denied(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"permission denied connecting to the pool at {path}"
    return (
        f"permission denied connecting to the pool at {path}: the socket is mode {stat.S_IMODE(st.st_mode):04o}, "
        f"owned by uid {st.st_uid} gid {st.st_gid}, and this process runs as uid {os.getuid()}"
    )


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, write: bool) -> None:
    waiter: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await waiter
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send ``data`` with ``fds`` attached to its first byte (then the rest, if the first call sent part)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sent = socket.send_fds(sock, [data], fds)
            break
        except BlockingIOError:
            await _ready(loop, sock.fileno(), write=True)
    if sent < len(data):
        await loop.sock_sendall(sock, data[sent:])


async def recv_frame_with_fds(sock: socket.socket, maxfds: int) -> tuple[bytes, list[int]]:
    """One frame (without its length prefix) and the descriptors that came with it; reads nothing past it.

    :raises ConnectionError: the peer closed first.
    :raises ValueError: a frame too long to be the protocol's.
    """
    loop = asyncio.get_running_loop()
    fds: list[int] = []
    head = b""
    while len(head) < _wire.LENGTH.size:
        try:
            data, got, _, _ = socket.recv_fds(sock, _wire.LENGTH.size - len(head), maxfds)
        except BlockingIOError:
            await _ready(loop, sock.fileno(), write=False)
            continue
        fds.extend(got)
        if not data:
            _close_all(fds)
            raise ConnectionError(errno.ECONNRESET, "the peer closed the connection")
        head += data
    (size,) = _wire.LENGTH.unpack(head)
    if size > _wire.MAX_FRAME:
        _close_all(fds)
        raise ValueError(f"a frame of {size} bytes: not the pool protocol")
    body = bytearray()
    try:
        while len(body) < size:
            chunk = await loop.sock_recv(sock, size - len(body))
            if not chunk:
                raise ConnectionError(errno.ECONNRESET, "the peer closed the connection")
            body += chunk
    except BaseException:
        _close_all(fds)
        raise
    return bytes(body), fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
