#!/usr/bin/env python3
"""Make the keys a TLS + authenticated-SuperNode deployment needs (Python's `cryptography` only).

    python docker/make_certs.py --out certs --sites hospital-a hospital-b hospital-c

writes into --out:
    ca.crt, ca.key                  a private certificate authority (keep ca.key offline)
    superlink.crt, superlink.key    the SuperLink's TLS certificate, signed by the CA, with SANs for
                                    localhost, 127.0.0.1, ::1, the compose service name `superlink`
                                    and every --san given
    supernodes/<site>.key, .pub     each site's SuperNode authentication key pair (EC P-384, OpenSSH
                                    format, as `flower-supernode --auth-supernode-private-key` and
                                    `flwr supernode register` expect); the .key never leaves the site
Existing files are kept unless --force, so re-running adds new sites without rotating others.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_SANS = ("localhost", "127.0.0.1", "::1", "superlink")


def _write(path: Path, data: bytes, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_ca(out: Path, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "medflower federation CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA384())
    )
    _write(out / "ca.key", _key_pem(key), private=True)
    _write(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return key, cert


def load_ca(out: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    cert = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    return key, cert  # type: ignore[return-value]


def make_server_cert(out: Path, ca_key, ca_cert: x509.Certificate, sans: list[str], days: int) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sans[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(_san(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write(out / "superlink.key", _key_pem(key), private=True)
    _write(out / "superlink.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)


def make_supernode_key(folder: Path, site: str) -> None:
    """EC P-384 key pair in OpenSSH format (what Flower 1.41 loads for SuperNode authentication)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(folder / f"{site}.key", private, private=True)
    _write(folder / f"{site}.pub", public + f" {site}\n".encode(), private=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("certs"))
    parser.add_argument("--sites", nargs="*", default=["hospital-a", "hospital-b", "hospital-c"])
    parser.add_argument("--san", nargs="*", default=[], help="extra DNS names / IPs of the SuperLink")
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--force", action="store_true", help="replace existing CA, certificate and keys")
    args = parser.parse_args(argv)
    out: Path = args.out
    if args.force or not (out / "ca.key").is_file():
        ca_key, ca_cert = make_ca(out, args.days)
        print(f"made CA: {out / 'ca.crt'}")
    else:
        ca_key, ca_cert = load_ca(out)
    if args.force or not (out / "superlink.crt").is_file():
        make_server_cert(out, ca_key, ca_cert, list(DEFAULT_SANS) + list(args.san), args.days)
        print(f"made SuperLink certificate: {out / 'superlink.crt'} (SANs: {', '.join(list(DEFAULT_SANS) + args.san)})")
    for site in args.sites:
        if args.force or not (out / "supernodes" / f"{site}.key").is_file():
            make_supernode_key(out / "supernodes", site)
            print(f"made SuperNode key pair: {out / 'supernodes' / site}.key/.pub")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
