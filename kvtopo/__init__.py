"""The `kvtopo` command and the local control plane used by tests, drills and the demo."""
