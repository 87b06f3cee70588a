"""The one rule for which control endpoints may be dialled (`kvtopo_worker.endpoints`)."""

from __future__ import annotations

import pytest

from kvtopo_worker.endpoints import EndpointError, parse_endpoint, pod_endpoint

ACCEPTED = {
    "10.0.0.7:8975": ("10.0.0.7", 8975, "10.0.0.7:8975"),
    "127.244.0.3:1": ("127.244.0.3", 1, "127.244.0.3:1"),
    "[fd00::7]:8975": ("fd00::7", 8975, "[fd00::7]:8975"),
    "[::1]:65535": ("::1", 65535, "[::1]:65535"),
    "[FD00:0:0::7]:80": ("fd00::7", 80, "[fd00::7]:80"),  # formatted back canonically
}

REFUSED = [
    "",
    "10.0.0.7",  # no port
    "10.0.0.7:",  # empty port
    "10.0.0.7:0",
    "10.0.0.7:65536",
    "10.0.0.7:+80",
    "10.0.0.7:\uff18\uff10",  # non-ASCII (fullwidth) digits
    "10.0.0.7:80:80",
    "169.254.169.254/latest/meta-data/iam/security-credentials/#:80",  # the SSRF probe
    "169.254.169.254:80",  # link-local: the cloud metadata service
    "10.0.0.7:80/v1/evil",
    "10.0.0.7:80?x=1",
    "10.0.0.7:80#frag",
    "user@10.0.0.7:80",
    "user:pw@10.0.0.7:80",
    "localhost:8975",  # host names are never dialled
    "metadata.google.internal:80",
    "0.0.0.0:80",
    "[::]:80",
    "224.0.0.1:80",
    "255.255.255.255:80",
    "[fe80::1]:80",
    "[fe80::1%25eth0]:80",  # zone ids
    "fd00::7:8975",  # IPv6 without brackets
    "[10.0.0.7]:80",  # IPv4 in brackets
    "[::ffff:169.254.169.254]:80",  # IPv4-mapped
    "010.000.000.007:80",  # leading zeros (octal in some parsers)
    "10.0.0.7:80 ",
    "10.0.0.7:80\r\nHost: evil",
    "x" * 100,
]


@pytest.mark.parametrize("text", sorted(ACCEPTED))
def test_ip_literal_endpoints_are_accepted_and_formatted_back(text: str) -> None:
    ep = parse_endpoint(text)
    host, port, formatted = ACCEPTED[text]
    assert (ep.host, ep.port, str(ep)) == (host, port, formatted)
    assert ep.url("/v1/state") == f"http://{formatted}/v1/state"


@pytest.mark.parametrize("text", REFUSED)
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(EndpointError):
        parse_endpoint(text)


def test_a_route_must_be_the_callers_own() -> None:
    with pytest.raises(ValueError):
        parse_endpoint("10.0.0.7:80").url("evil.example/x")


@pytest.mark.parametrize(
    ("ips", "annotation", "allow_host", "expected"),
    [
        (["10.1.2.3"], "", False, "10.1.2.3:8975"),
        (["fd00::5", "10.1.2.3"], "", False, "[fd00::5]:8975"),  # primary IP, bracketed
        (["10.1.2.3"], "9000", False, "10.1.2.3:9000"),  # the annotation names a port
        (["10.1.2.3"], ":9000", False, "10.1.2.3:9000"),
        (["10.1.2.3"], "127.0.0.1:9000", True, "127.0.0.1:9000"),  # development flag only
        (["10.1.2.3"], "[::1]:9000", True, "[::1]:9000"),
    ],
)
def test_the_endpoint_is_the_pod_ip_and_the_control_port(
    ips: list[str], annotation: str, allow_host: bool, expected: str
) -> None:
    ep, refused = pod_endpoint(ips, annotation, 8975, allow_host=allow_host)
    assert refused == "" and str(ep) == expected


@pytest.mark.parametrize(
    ("ips", "annotation"),
    [([], ""), ([], "8975"), (["10.1.2.3"], "pending"), (["10.1.2.3"], " pending ")],
)
def test_no_endpoint_while_the_engine_is_not_serving(ips: list[str], annotation: str) -> None:
    assert pod_endpoint(ips, annotation, 8975) == (None, "")


@pytest.mark.parametrize(
    ("annotation", "allow_host"),
    [
        ("127.0.0.1:9000", False),  # a host without the development flag
        ("[::1]:9000", False),
        ("169.254.169.254/latest/meta-data/iam/security-credentials/#:80", False),
        ("169.254.169.254/latest/meta-data/iam/security-credentials/#:80", True),
        ("user@127.0.0.1:9000", True),
        ("127.0.0.1:9000/x", True),
        ("localhost:9000", True),
        ("70000", False),
        ("0", False),
    ],
)
def test_refused_annotations_say_why_and_give_no_endpoint(
    annotation: str, allow_host: bool
) -> None:
    ep, refused = pod_endpoint(["10.1.2.3"], annotation, 8975, allow_host=allow_host)
    assert ep is None and refused.startswith("refused control-endpoint annotation")


def test_a_pod_ip_that_cannot_be_dialled_is_refused() -> None:
    ep, refused = pod_endpoint(["169.254.1.1"], "", 8975)
    assert ep is None and "pod IP" in refused
