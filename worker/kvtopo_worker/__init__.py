"""kvtopo worker: the in-engine registry of remote NIXL agents and the push-mode KV data path."""
