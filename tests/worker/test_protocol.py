"""The wire contract: round trips, the compatibility hash, and garbage that must become a
typed error (never any other exception)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo_worker import protocol as p


def _meta(**compat: object) -> p.EngineMetadata:
    info = p.CompatInfo(block_len=4096, **compat)  # type: ignore[arg-type]
    return p.EngineMetadata(
        engine_id="e1",
        role="prefill",
        agent_name="kvtopo-e1",
        agent_metadata=b"\x01\x02",
        kv_addr=1 << 40,
        num_blocks=8,
        block_len=4096,
        compat=info,
        compat_hash=p.compat_hash(info),
        notif_key=bytes(range(32)),
    )


def test_metadata_round_trip() -> None:
    meta = _meta()
    assert p.decode_metadata(p.encode_metadata(meta), meta.compat_hash) == meta


@pytest.mark.parametrize(
    "field",
    [
        "transfer_mode",
        "kv_layout",
        "dtype",
        "block_size",
        "block_len",
        "model_id",
        "protocol_version",
    ],
)
def test_every_compat_field_changes_the_hash(field: str) -> None:
    base = p.CompatInfo()
    changed = {
        "transfer_mode": "pull",
        "kv_layout": "hnd",
        "dtype": "fp8",
        "block_size": 32,
        "block_len": 1,
        "model_id": "other",
        "protocol_version": 99,
    }[field]
    other = msgspec.structs.replace(base, **{field: changed})
    assert p.compat_hash(other) != p.compat_hash(base)
    assert p.compat_hash(base) == p.compat_hash(p.CompatInfo())  # stable


def test_incompatible_peer_is_a_typed_error_with_both_hashes() -> None:
    theirs = _meta(model_id="llama")
    with pytest.raises(p.IncompatibleEngine) as err:
        p.decode_metadata(p.encode_metadata(theirs), "0000000000000000")
    assert err.value.remote_hash == theirs.compat_hash
    assert err.value.local_hash == "0000000000000000"
    assert err.value.failure_type is p.FailureType.INCOMPATIBLE


def test_other_protocol_version_is_refused() -> None:
    meta = _meta()
    env = p.Envelope(
        p.PROTOCOL_VERSION + 1, meta.compat_hash, msgspec.Raw(msgspec.msgpack.encode(meta))
    )
    with pytest.raises(p.VersionMismatch, match="protocol version"):
        p.decode_metadata(msgspec.msgpack.encode(env), meta.compat_hash)


def test_payload_that_lies_about_its_hash_is_refused() -> None:
    meta = _meta()
    forged = msgspec.structs.replace(meta, compat=p.CompatInfo(model_id="else"))
    env = p.Envelope(
        p.PROTOCOL_VERSION, meta.compat_hash, msgspec.Raw(msgspec.msgpack.encode(forged))
    )
    with pytest.raises(p.MalformedMessage, match="disagrees"):
        p.decode_metadata(msgspec.msgpack.encode(env), meta.compat_hash)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_garbage_metadata_is_only_ever_a_protocol_error(data: bytes) -> None:
    try:
        decoded = p.decode_metadata(data, _meta().compat_hash)
    except p.ProtocolError as exc:
        assert exc.message  # a typed refusal that says why
        return
    assert isinstance(decoded, p.EngineMetadata)  # or, by chance, valid metadata


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([p.REG_PREFIX, p.DONE_PREFIX, p.FAIL_PREFIX, b""]),
    st.one_of(
        st.binary(max_size=256),
        st.builds(
            msgspec.msgpack.encode,
            st.dictionaries(
                st.sampled_from(
                    [
                        "request_id",
                        "decode_engine_id",
                        "prefill_engine_id",
                        "block_ids",
                        "num_blocks",
                        "reason",
                        "x",
                    ]
                ),
                st.one_of(
                    st.integers(min_value=-(2**63), max_value=2**63 - 1),
                    st.text(max_size=5),
                    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
                ),
            ),
        ),
    ),
)
def test_garbage_notifications_are_only_ever_malformed(prefix: bytes, body: bytes) -> None:
    try:
        msg = p.decode_notification(prefix + body)
    except p.MalformedMessage:
        return
    assert isinstance(msg, (p.PushRegistration, p.PushDone, p.PushFail))


def test_notification_round_trip_and_bounds() -> None:
    reg = p.PushRegistration(
        request_id="r",
        decode_engine_id="d",
        prefill_engine_id="p",
        block_ids=[1, 2],
        expires_at=1e12,
        write_timeout_s=30.0,
    )
    assert p.decode_notification(p.encode_notification(reg)) == reg
    assert p.encode_notification(reg).startswith(b"PUSH_REG:")
    for bad in (
        msgspec.structs.replace(reg, block_ids=[]),
        msgspec.structs.replace(reg, block_ids=[-1]),
        msgspec.structs.replace(reg, request_id=""),
        msgspec.structs.replace(reg, request_id="x" * 300),
    ):
        with pytest.raises(p.MalformedMessage):
            p.decode_notification(p.encode_notification(bad))
    with pytest.raises(p.MalformedMessage, match="exceeds"):
        p.decode_notification(p.REG_PREFIX + b"\x00" * (p.MAX_NOTIFICATION_BYTES + 1))


def test_control_bodies_name_the_bad_field() -> None:
    with pytest.raises(p.MalformedMessage, match=r"\$.role"):
        p.decode_json_body(b'{"endpoint": "h:1", "role": "router"}', p.PeerAddRequest)
    with pytest.raises(p.MalformedMessage, match="unknown field"):
        p.decode_json_body(b'{"endpoint": "h:1", "role": "decode", "x": 1}', p.PeerAddRequest)
    assert (
        p.decode_json_body(b'{"endpoint": "h:1", "role": "decode"}', p.PeerAddRequest).role
        == "decode"
    )


def test_protocol_imports_neither_torch_nor_nixl() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvtopo_worker.protocol; "
        "bad = [m for m in ('torch', 'nixl', 'kopf', 'kubernetes') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_peer_add_without_a_rank_encodes_as_older_workers_expect() -> None:
    # Workers before TP support refuse unknown fields: an unset rank must not appear.
    item = p.PeerAddItem(engine_id="e", endpoint="h:1", role="prefill")
    assert msgspec.json.decode(msgspec.json.encode(item)) == {
        "engine_id": "e",
        "endpoint": "h:1",
        "role": "prefill",
    }
    body = p.PeerAddRequest(endpoint="h:1", role="prefill", rank=1)
    assert msgspec.json.decode(msgspec.json.encode(body))["rank"] == 1
