"""CurveZMQ for the ZMQ entrypoint: the server's key pair, a folder of the client public keys
it accepts, and the key files `pagedllm keygen` writes (ZeroMQ's own certificate format:
NAME.key holds the public key, NAME.key_secret the key pair, readable by its owner only).

On loopback and ipc:// the socket may run without keys; on any other address the server
refuses to start without them unless told `--zmq-allow-insecure`."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator


def keygen(folder: str, name: str) -> tuple[str, str]:
    """Write NAME.key and NAME.key_secret into `folder`; returns their paths."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    os.makedirs(folder, exist_ok=True)
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return public, secret


def load_public_key(path: str) -> bytes:
    public, _ = zmq.auth.load_certificate(path)
    return public


def load_key_pair(path: str) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path}: holds no secret key (use the .key_secret file)")
    return public, secret


def is_local_endpoint(endpoint: str) -> bool:
    """ipc://, inproc:// and tcp:// on a loopback address or localhost."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: not provably local


@dataclass
class ServerCurve:
    secret_key_file: str  # the server's NAME.key_secret
    authorized_keys: str  # a folder of client NAME.key files

    def check(self) -> None:
        load_key_pair(self.secret_key_file)
        if not os.path.isdir(self.authorized_keys):
            raise ValueError(f"--zmq-authorized-keys: {self.authorized_keys} is not a folder")

    def apply(self, ctx: zmq.asyncio.Context, sock: zmq.Socket) -> AsyncioAuthenticator:
        """Make `sock` a CURVE server that accepts only the authorized clients' keys."""
        public, secret = load_key_pair(self.secret_key_file)
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=self.authorized_keys)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        return auth


def check_endpoint_security(endpoint: str, curve: ServerCurve | None, allow_insecure: bool) -> None:
    if curve is not None:
        curve.check()
    elif not is_local_endpoint(endpoint) and not allow_insecure:
        raise ValueError(
            f"--zmq-endpoint: {endpoint} is reachable from other hosts and the socket has no authentication; "
            "give --zmq-curve-secret-key and --zmq-authorized-keys (make keys with `pagedllm keygen`), "
            "or --zmq-allow-insecure to serve it anyway"
        )
