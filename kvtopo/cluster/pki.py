"""The local control plane's certificates and kubeconfigs.

Owns one throw-away certificate authority per cluster and everything it signs:

- the serving certificate for ``127.0.0.1``/``localhost`` (kube-apiserver, and the secure
  ports of the controller manager and scheduler),
- client certificates: the admin's (``O=system:masters``), the components' identities,
  and any ``user``/``groups`` a test wants (:func:`write_client_kubeconfig`),
- the service-account token signing key pair,

plus kubeconfig files embedding them. Keys are ECDSA P-256: generating one takes
microseconds where RSA-2048 takes tens of milliseconds, and every Kubernetes component
accepts them. Called by :mod:`kvtopo.cluster.local_cluster`; nothing here starts processes.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)
CLOCK_SKEW = datetime.timedelta(hours=1)

# Names the serving certificate answers to: loopback, plus the in-cluster names of the
# `kubernetes` Service (10.0.0.1 is the first address of --service-cluster-ip-range).
SERVING_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
SERVING_IPS = ("127.0.0.1", "10.0.0.1")

ADMIN_USER = "kvtopo-admin"
MASTERS_GROUP = "system:masters"


@dataclass(frozen=True)
class IssuedCertificate:
    """A PEM certificate and its PEM (PKCS#8, unencrypted) private key."""

    cert_pem: bytes
    key_pem: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class CertificateAuthority:
    """The cluster's CA: signs serving and client certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, common_name: str = "kvtopo-local-ca") -> CertificateAuthority:
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{key_path} does not hold an ECDSA key")
        return cls(cert, key)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)

    def issue_serving(
        self,
        common_name: str,
        dns_names: tuple[str, ...] = SERVING_DNS_NAMES,
        ips: tuple[str, ...] = SERVING_IPS,
    ) -> IssuedCertificate:
        """A TLS server certificate for ``dns_names`` and ``ips``."""
        sans: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        return self._issue(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]),
            ExtendedKeyUsageOID.SERVER_AUTH,
            x509.SubjectAlternativeName(sans),
        )

    def issue_client(self, user: str, groups: tuple[str, ...] = ()) -> IssuedCertificate:
        """A client certificate Kubernetes reads as ``user`` (CN) in ``groups`` (O)."""
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, user))
        return self._issue(x509.Name(attributes), ExtendedKeyUsageOID.CLIENT_AUTH, None)

    def _issue(
        self,
        subject: x509.Name,
        usage: x509.ObjectIdentifier,
        sans: x509.SubjectAlternativeName | None,
    ) -> IssuedCertificate:
        key = _new_key()
        now = _now()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
        )
        if sans is not None:
            builder = builder.add_extension(sans, critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return IssuedCertificate(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by the owner only (keys, kubeconfigs with embedded keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


@dataclass(frozen=True)
class ClusterPki:
    """Paths of one cluster's certificate files (all under ``directory``)."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.directory / "serving.crt"

    @property
    def serving_key(self) -> Path:
        return self.directory / "serving.key"

    @property
    def admin_cert(self) -> Path:
        return self.directory / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.directory / "admin.key"

    @property
    def kubelet_client_cert(self) -> Path:
        """The API server's client certificate towards kubelets (logs, exec)."""
        return self.directory / "kubelet-client.crt"

    @property
    def kubelet_client_key(self) -> Path:
        return self.directory / "kubelet-client.key"

    @property
    def service_account_key(self) -> Path:
        """The token signing key (private)."""
        return self.directory / "service-account.key"

    @property
    def service_account_pub(self) -> Path:
        """The token verification key (public)."""
        return self.directory / "service-account.pub"

    def authority(self) -> CertificateAuthority:
        return CertificateAuthority.load(self.ca_cert, self.ca_key)


def issue_cluster_pki(directory: Path) -> ClusterPki:
    """Create a fresh CA and everything the control plane needs, under ``directory``."""
    pki = ClusterPki(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca = CertificateAuthority.create()
    pki.ca_cert.write_bytes(ca.cert_pem)
    _write_private(pki.ca_key, ca.key_pem)

    serving = ca.issue_serving("kvtopo-local-apiserver")
    pki.serving_cert.write_bytes(serving.cert_pem)
    _write_private(pki.serving_key, serving.key_pem)

    admin = ca.issue_client(ADMIN_USER, (MASTERS_GROUP,))
    pki.admin_cert.write_bytes(admin.cert_pem)
    _write_private(pki.admin_key, admin.key_pem)

    kubelet_client = ca.issue_client("kube-apiserver-kubelet-client")
    pki.kubelet_client_cert.write_bytes(kubelet_client.cert_pem)
    _write_private(pki.kubelet_client_key, kubelet_client.key_pem)

    sa_key = _new_key()
    _write_private(pki.service_account_key, _key_pem(sa_key))
    pki.service_account_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca_pem: bytes,
    client: IssuedCertificate,
    user: str,
    context: str = "kvtopo-local",
) -> Path:
    """Write a self-contained kubeconfig (certificates embedded, mode 0600)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": context,
                "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert_pem),
                    "client-key-data": _b64(client.key_pem),
                },
            }
        ],
        "contexts": [{"name": context, "context": {"cluster": context, "user": user}}],
        "current-context": context,
        "preferences": {},
    }
    _write_private(path, yaml.safe_dump(config, sort_keys=False).encode())
    return path


def write_admin_kubeconfig(pki: ClusterPki, path: Path, server: str) -> Path:
    """The admin kubeconfig (``O=system:masters``) for ``server``."""
    client = IssuedCertificate(pki.admin_cert.read_bytes(), pki.admin_key.read_bytes())
    return write_kubeconfig(
        path, server=server, ca_pem=pki.ca_cert.read_bytes(), client=client, user=ADMIN_USER
    )


def write_client_kubeconfig(
    pki: ClusterPki, path: Path, server: str, user: str, groups: tuple[str, ...] = ()
) -> Path:
    """A kubeconfig authenticating as ``user`` in ``groups`` by a fresh client certificate.

    What RBAC then allows is up to the caller's Roles and bindings; ``system:masters`` in
    ``groups`` bypasses RBAC altogether.
    """
    ca = pki.authority()
    return write_kubeconfig(
        path, server=server, ca_pem=ca.cert_pem, client=ca.issue_client(user, groups), user=user
    )
