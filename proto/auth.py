"""Credentials both ends use: the cluster token, TLS files, and channels that present them.

Every call to a planner or an agent carries the cluster token as call metadata
(``authorization: Bearer <token>``); servers compare it in constant time
(`reshard.server.common.auth`). The token comes from ``token=``, else the
``RESHARD_TOKEN`` environment variable, else the file ``RESHARD_TOKEN_FILE``
names. With TLS files every channel is TLS, and mutual when a key and
certificate are given (``reshard certs`` makes a development set). See
``docs/security.md``.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import grpc

from reshard.proto.errors import InvalidArgumentError

__all__ = ["TlsFiles", "resolve_token", "read_token_file", "channel", "METADATA_KEY", "TOKEN_ENV", "TOKEN_FILE_ENV"]

METADATA_KEY = "authorization"
TOKEN_ENV = "RESHARD_TOKEN"
TOKEN_FILE_ENV = "RESHARD_TOKEN_FILE"
_MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this end's certificate and key, and the CA that signed the other ends' certificates."""

    cert: Optional[str] = None
    key: Optional[str] = None
    ca: Optional[str] = None
    # The name every server's certificate is checked against, whatever address is dialled: where peers are
    # dialled by addresses no certificate can name in advance (Kubernetes pod IPs), one certificate for a
    # shared name serves them all. None: the dialled host name.
    server_name: Optional[str] = None

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise InvalidArgumentError(f"TLS needs a certificate and its key together; got cert={self.cert!r}, "
                                       f"key={self.key!r}")
        if not (self.cert or self.ca):
            raise InvalidArgumentError("TLS needs a certificate and key (a server), a CA (a client), or all three")
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA", self.ca)):
            if path and not Path(path).is_file():
                raise InvalidArgumentError(f"TLS {what} file {path!r} does not exist")

    @classmethod
    def from_args(cls, cert: Optional[str], key: Optional[str], ca: Optional[str],
                  server_name: Optional[str] = None) -> Optional["TlsFiles"]:
        """None when no file is named (plain TCP)."""
        if server_name and not (cert or key or ca):
            raise InvalidArgumentError(f"a TLS server name ({server_name!r}) needs TLS files: --tls-ca at least")
        return cls(cert, key, ca, server_name or None) if (cert or key or ca) else None

    def _read(self, path: Optional[str]) -> Optional[bytes]:
        return Path(path).read_bytes() if path else None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca), private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.cert:
            raise InvalidArgumentError("a TLS server needs --tls-cert and --tls-key")
        ca = self._read(self.ca)
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))], root_certificates=ca,
                                           require_client_auth=ca is not None)


def read_token_file(path: str) -> str:
    """The token a file holds (surrounding whitespace dropped); an error naming the file if it holds none."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise InvalidArgumentError(f"cannot read the token file {path!r}: {e.strerror or e}") from None
    return _checked(token, f"the token file {path!r}")


def _checked(token: str, where: str) -> str:
    if len(token) < _MIN_TOKEN_CHARS or not token.isprintable() or any(c.isspace() for c in token):
        raise InvalidArgumentError(f"{where} holds no usable token: a token is at least {_MIN_TOKEN_CHARS} printable "
                                   f"characters without spaces (make one with: python -c \"import secrets; "
                                   f"print(secrets.token_urlsafe(32))\")")
    return token


def resolve_token(token: Optional[str] = None, token_file: Optional[str] = None) -> Optional[str]:
    """The cluster token: ``token``, else ``token_file``'s, else ``$RESHARD_TOKEN``, else ``$RESHARD_TOKEN_FILE``'s;
    surrounding whitespace dropped, as from a file (``token=open("cluster-token.txt").read()`` ends in a newline)."""
    if token:
        return _checked(token.strip(), "token=")
    if token_file:
        return read_token_file(token_file)
    if os.environ.get(TOKEN_ENV):
        return _checked(os.environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}")
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(os.environ[TOKEN_FILE_ENV])
    return None


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call's metadata."""

    def __init__(self, token: str):
        self._entry = (METADATA_KEY, f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> _Details:
        return _Details(d.method, d.timeout, [*(d.metadata or ()), self._entry], d.credentials,
                        d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def channel(address: str, *, token: Optional[str] = None, tls: Optional[TlsFiles] = None,
            options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to a planner or agent that presents ``token`` on every call, over TLS when ``tls`` is given."""
    if tls is not None:
        if tls.server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
        ch = grpc.secure_channel(address, tls.channel_credentials(), options=list(options))
    else:
        ch = grpc.insecure_channel(address, options=list(options))
    return grpc.intercept_channel(ch, _Token(token)) if token else ch
