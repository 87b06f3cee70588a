"""kvtopo operator: watches engine pods and keeps each KVTopology connected, evicting stale engines."""
