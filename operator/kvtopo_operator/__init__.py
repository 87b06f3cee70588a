"""kvtopo operator: watches engine pods, keeps each KVTopology connected, evicts stale engines."""
