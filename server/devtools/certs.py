"""``reshard certs``: a development CA and a certificate per name, for mutual TLS on every gRPC port.

Each certificate serves and dials (agents do both), and names its host as a DNS
name plus ``localhost``, ``127.0.0.1`` and ``::1``, so the same files work on one
machine and on a compose network where peers dial each other by service name.
Keys are written readable by their owner only. For production, use your own PKI:
the services only need PEM files (``--tls-cert``, ``--tls-key``, ``--tls-ca``).
"""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from reshard.errors import ReshardError
from reshard.plan_command import HelpFormatter

__all__ = ["make_certs", "add_certs_command"]

_LOOPBACK_IPS = ("127.0.0.1", "::1")


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _require_cryptography() -> None:
    if importlib.util.find_spec("cryptography") is None:
        raise ReshardError("reshard certs needs the cryptography package: pip install cryptography")


def make_certs(out: str | Path, names: Sequence[str], days: int = 365,
               ips: Sequence[str] = ()) -> dict[str, tuple[Path, Path]]:
    """Write ``ca.pem`` and, per name, ``NAME.pem`` and ``NAME-key.pem`` into ``out``; returns name -> (cert, key).

    An existing CA in ``out`` (``ca.pem`` and ``ca-key.pem``) is reused, so certificates for new hosts can be
    added later.
    """
    _require_cryptography()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not names:
        raise ReshardError("reshard certs needs at least one name (--names planner,host0,...)")
    bad = [n for n in names if not n or not all(c.isalnum() or c in ".-_" for c in n)]
    if bad:
        raise ReshardError(f"certificate names must be host names (letters, digits, '.', '-', '_'); got {bad}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_cert_path, ca_key_path = out / "ca.pem", out / "ca-key.pem"
    if ca_cert_path.exists() and ca_key_path.exists():
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "reshard development CA")])
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .sign(ca_key, hashes.SHA256()))
        _write(ca_key_path, ca_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), private=True)
        _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)

    written = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        alt = [x509.DNSName(name), x509.DNSName("localhost")]
        alt += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in (*_LOOPBACK_IPS, *ips)]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(alt), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        cert_path, key_path = out / f"{name}.pem", out / f"{name}-key.pem"
        _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), private=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
        written[name] = (cert_path, key_path)
    return written


def add_certs_command(sub) -> None:
    p = sub.add_parser("certs", help="make a development CA and a TLS certificate per host (mutual TLS)",
                       formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="folder for ca.pem, NAME.pem and NAME-key.pem")
    p.add_argument("--names", required=True,
                   help="comma-separated names to certify: the planner's and every agent's host name, and one per "
                        "client (e.g. planner,host0,host1,client)")
    p.add_argument("--ip", action="append", default=[], help="an extra IP address every certificate names")
    p.add_argument("--days", type=int, default=365, help="validity")
    p.set_defaults(func=_run_certs)


def _run_certs(args) -> int:
    written = make_certs(args.out, [n for n in args.names.split(",") if n], args.days, args.ip)
    out = Path(args.out)
    print(f"CA       {out / 'ca.pem'} (its key {out / 'ca-key.pem'}: keep it off the cluster)")
    for name, (cert, key) in written.items():
        print(f"{name:<8} --tls-cert {cert} --tls-key {key} --tls-ca {out / 'ca.pem'}")
    return 0
