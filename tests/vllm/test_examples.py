"""examples/vllm: the Deployments' --kv-transfer-config is one vLLM accepts, and it loads
KVTopoConnector with the side each Deployment's role label says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_example_deployment_loads_the_connector(role: str) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtopo_worker.vllm import KVTopoConnector

    doc = yaml.safe_load((EXAMPLE / f"{role}-deployment.yaml").read_text())
    pod = doc["spec"]["template"]
    assert pod["metadata"]["labels"]["kvtopo.dev/role"] == role
    container = pod["spec"]["containers"][0]
    command = container["command"]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    kvc = KVTransferConfig(**config)
    assert KVConnectorFactory.get_connector_class(kvc) is KVTopoConnector
    assert {"producer": "prefill", "consumer": "decode"}[kvc.kv_role.removeprefix("kv_")] == role
    port = config["kv_connector_extra_config"]["control_port"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    topology = yaml.safe_load((EXAMPLE / "kvtopology.yaml").read_text())
    assert named["kvtopo-control"] == port == topology["spec"]["controlPort"]
    env = {e["name"]: e for e in container["env"]}
    assert {"KVTOPO_POD_IP", "KVTOPO_OPERATOR_KEY_FILE", "KVTOPO_POD_UID"} <= set(env)
    # The operator's public key from its ConfigMap; no Secret, no peer token (the operator
    # pairs these engines: no lazy handshakes).
    assert not {"KVTOPO_TOKEN_FILE", "KVTOPO_PEER_TOKEN_FILE"} & set(env)
    volumes = pod["spec"]["volumes"]
    assert [v["configMap"]["name"] for v in volumes] == ["kvtopo-operator-key"]
    [mount] = container["volumeMounts"]
    key_file = env["KVTOPO_OPERATOR_KEY_FILE"]["value"]
    assert key_file == f"{mount['mountPath']}/operator.pem"
    assert pod["spec"]["readinessGates"] == [{"conditionType": "kvtopo.dev/kv-connected"}]
