"""kvtopo for vLLM engines: the only package of kvtopo that imports vllm.

`KVTopoConnector` (`connector`) is vLLM's KV connector over the kvtopo worker; vLLM loads
it with `"kv_connector": "KVTopoConnector", "kv_connector_module_path": "kvtopo_worker.vllm"`.
"""

from kvtopo_worker.vllm.connector import KVTopoConnector, KVTopoConnectorMetadata

__all__ = ["KVTopoConnector", "KVTopoConnectorMetadata"]
