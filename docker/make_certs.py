#!/usr/bin/env python3
"""Make the keys a TLS + authenticated-SuperNode deployment needs (Python's `cryptography` only).

Each party makes its own secrets; only public files travel (docs/deployment.md, "TLS and
authenticated SuperNodes"):

    # the operator, on the SuperLink host (or an offline machine for the CA):
    python docker/make_certs.py link --out certs [--san link.example.org] [--ca-dir offline-ca]
        ca.crt, ca.key                 a private certificate authority (in --ca-dir if given: keep it offline)
        superlink.crt, superlink.key   the SuperLink's (and its front proxy's) TLS certificate, signed by
                                       the CA, SANs localhost, 127.0.0.1, ::1, `superlink` (compose) and --san
    # each site, on its own machine; it sends only SITE.pub (and reads its fingerprint to the operator):
    python docker/make_certs.py site-key --out keys --name hospital-a
        hospital-a.key, hospital-a.pub the SuperNode authentication key pair (EC P-384, OpenSSH format, as
                                       `flower-supernode --auth-supernode-private-key` expects)
    # the operator again, with the public keys the sites sent:
    python docker/make_certs.py accept --out certs hospital-a.pub hospital-b.pub
        supernodes/<site>.pub          checked public keys, ready for `flwr supernode register`

    # tests and single-machine demos only: all of the above on one machine
    python docker/make_certs.py --out certs --sites site-0 site-1

Private keys are created with mode 0600 (never readable by others, not even for a moment), their
folders with 0700. Certificates carry subject and authority key identifiers, which strict verifiers
(OpenSSL's X509_STRICT, Python 3.13's default context) require. Existing files are kept unless
--force, so re-running adds new sites without rotating others.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import ipaddress
import os
import sys
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_SANS = ("localhost", "127.0.0.1", "::1", "superlink")
SITE_CURVE = ec.SECP384R1


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write ``data`` to ``path`` atomically; a private file is created with mode 0600 from the start."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o755)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates 0600
    try:
        if not private:
            os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def _key_usage(**on: bool) -> x509.KeyUsage:
    fields = (
        "digital_signature",
        "content_commitment",
        "key_encipherment",
        "data_encipherment",
        "key_agreement",
        "key_cert_sign",
        "crl_sign",
        "encipher_only",
        "decipher_only",
    )
    return x509.KeyUsage(**{f: on.get(f, False) for f in fields})


def make_ca(out: Path, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "medflower federation CA")])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(digital_signature=True, key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
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
    now = dt.datetime.now(dt.UTC)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
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
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write(out / "superlink.key", _key_pem(key), private=True)
    _write(out / "superlink.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)


def fingerprint(public_key) -> str:
    """SHA-256 of the OpenSSH public key blob, as `ssh-keygen -l` prints it: to compare out of band."""
    blob = public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).split()[1]
    digest = hashlib.sha256(base64.b64decode(blob)).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def make_supernode_key(folder: Path, site: str) -> str:
    """EC P-384 key pair in OpenSSH format (what Flower 1.41 loads for SuperNode authentication);
    returns the public key's fingerprint."""
    key = ec.generate_private_key(SITE_CURVE())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(folder / f"{site}.key", private, private=True)
    _write(folder / f"{site}.pub", public + f" {site}\n".encode(), private=False)
    return fingerprint(key.public_key())


def check_public_key(path: Path):
    """The site public key in ``path``; refuses anything else, above all a private key."""
    data = path.read_bytes()
    if b"PRIVATE KEY" in data:
        raise ValueError(
            f"{path} holds a PRIVATE key: it must never leave its site. Delete every copy of it here and ask "
            "the site for a new key pair (it sends only the .pub)."
        )
    try:
        key = serialization.load_ssh_public_key(data.strip())
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path} is not an OpenSSH public key: {err}") from err
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, SITE_CURVE):
        raise ValueError(f"{path}: expected an EC P-384 key (make it with `make_certs.py site-key`)")
    return key


def cmd_link(args) -> None:
    out: Path = args.out
    ca_dir: Path = args.ca_dir or out
    if args.force or not (ca_dir / "ca.key").is_file():
        ca_key, ca_cert = make_ca(ca_dir, args.days)
        print(f"made CA: {ca_dir / 'ca.crt'} (keep {ca_dir / 'ca.key'} offline)")
    else:
        ca_key, ca_cert = load_ca(ca_dir)
    if ca_dir.resolve() != out.resolve():  # the SuperLink's folder gets the CA certificate, not its key
        _write(out / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    sans = list(DEFAULT_SANS) + list(args.san)
    if args.force or not (out / "superlink.crt").is_file():
        make_server_cert(out, ca_key, ca_cert, sans, args.days)
        print(f"made SuperLink certificate: {out / 'superlink.crt'} (SANs: {', '.join(sans)})")


def cmd_site_key(args) -> None:
    key = args.out / f"{args.name}.key"
    if key.is_file() and not args.force:
        pub = check_public_key(args.out / f"{args.name}.pub")
        print(f"kept existing key pair {key} (fingerprint {fingerprint(pub)})")
        return
    fp = make_supernode_key(args.out, args.name)
    print(f"made SuperNode key pair: {key} (mode 0600, stays here) and {args.out / args.name}.pub")
    print(f"send only {args.name}.pub to the operator; its fingerprint, to read out separately: {fp}")


def cmd_accept(args) -> None:
    for path in args.public_keys:
        key = check_public_key(path)
        site = path.name.removesuffix(".pub")
        target = args.out / "supernodes" / f"{site}.pub"
        if target.is_file() and not args.force and fingerprint(check_public_key(target)) != fingerprint(key):
            raise ValueError(f"{target} already holds another key for {site}: rotate it on purpose with --force")
        _write(target, path.read_bytes(), private=False)
        print(f"accepted {site}: {target} (fingerprint {fingerprint(key)}: compare it with the site's)")


def cmd_all_on_one_machine(args) -> None:
    """Tests and single-machine demos: CA, SuperLink certificate and every site's key pair here."""
    cmd_link(args)
    for site in args.sites:
        if args.force or not (args.out / "supernodes" / f"{site}.key").is_file():
            make_supernode_key(args.out / "supernodes", site)
            print(f"made SuperNode key pair: {args.out / 'supernodes' / site}.key/.pub (single-machine demo)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=Path("certs"))
    common.add_argument("--force", action="store_true", help="replace existing files (rotation)")
    link = argparse.ArgumentParser(add_help=False)
    link.add_argument("--san", nargs="*", default=[], help="extra DNS names / IPs of the SuperLink")
    link.add_argument("--days", type=int, default=365)
    link.add_argument("--ca-dir", type=Path, help="where ca.key/ca.crt live if not --out (keep it off the SuperLink)")

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("link", parents=[common, link], help="operator: CA and SuperLink certificate")
    site = sub.add_parser("site-key", parents=[common], help="a site: its own SuperNode key pair")
    site.add_argument("--name", default="site", help="the site's name (file names and key comment)")
    accept = sub.add_parser("accept", parents=[common], help="operator: check and collect sites' public keys")
    accept.add_argument("public_keys", nargs="+", type=Path)

    if argv and argv[0] in sub.choices:
        args = parser.parse_args(argv)
    else:  # no subcommand: everything on one machine (tests, single-machine demos)
        legacy = argparse.ArgumentParser(parents=[common, link], description="tests and single-machine demos")
        legacy.add_argument("--sites", nargs="*", default=[])
        args = legacy.parse_args(argv)
        args.command = "all"
    handler = {"link": cmd_link, "site-key": cmd_site_key, "accept": cmd_accept, "all": cmd_all_on_one_machine}
    try:
        handler[args.command](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
