"""The cluster's certificates and kubeconfigs, checked with `cryptography` itself."""

from __future__ import annotations

import base64
import ipaddress
import stat
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvtopo.cluster.pki import (
    ClusterPki,
    issue_cluster_pki,
    write_admin_kubeconfig,
    write_client_kubeconfig,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> ClusterPki:
    return issue_cluster_pki(tmp_path_factory.mktemp("pki"))


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _names(cert: x509.Certificate, oid: x509.ObjectIdentifier) -> list[str]:
    return [str(attribute.value) for attribute in cert.subject.get_attributes_for_oid(oid)]


def test_serving_cert_is_signed_by_the_ca_for_loopback(pki: ClusterPki) -> None:
    ca, serving = _cert(pki.ca_cert), _cert(pki.serving_cert)
    serving.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    usage = serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_admin_cert_is_a_system_masters_client_cert(pki: ClusterPki) -> None:
    admin = _cert(pki.admin_cert)
    admin.verify_directly_issued_by(_cert(pki.ca_cert))
    assert _names(admin, NameOID.ORGANIZATION_NAME) == ["system:masters"]
    usage = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usage
    assert ExtendedKeyUsageOID.SERVER_AUTH not in usage


def test_private_keys_are_owner_only(pki: ClusterPki) -> None:
    for key in (pki.ca_key, pki.serving_key, pki.admin_key, pki.service_account_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert b"PUBLIC KEY" in pki.service_account_pub.read_bytes()


def test_client_kubeconfig_carries_user_and_groups(pki: ClusterPki, tmp_path: Path) -> None:
    path = write_client_kubeconfig(
        pki, tmp_path / "alice.kubeconfig", "https://127.0.0.1:6443", "alice", ("dev", "ops")
    )
    config = yaml.safe_load(path.read_text())
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    ca_pem = base64.b64decode(config["clusters"][0]["cluster"]["certificate-authority-data"])
    assert ca_pem == pki.ca_cert.read_bytes()
    user = config["users"][0]["user"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(user["client-certificate-data"]))
    cert.verify_directly_issued_by(_cert(pki.ca_cert))
    assert _names(cert, NameOID.COMMON_NAME) == ["alice"]
    assert _names(cert, NameOID.ORGANIZATION_NAME) == ["dev", "ops"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_admin_kubeconfig_uses_the_admin_cert(pki: ClusterPki, tmp_path: Path) -> None:
    path = write_admin_kubeconfig(pki, tmp_path / "kubeconfig", "https://127.0.0.1:1")
    config = yaml.safe_load(path.read_text())
    assert config["current-context"] == config["contexts"][0]["name"]
    cert_pem = base64.b64decode(config["users"][0]["user"]["client-certificate-data"])
    assert cert_pem == pki.admin_cert.read_bytes()
