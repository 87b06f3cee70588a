"""The local Kubernetes control plane: binaries, certificates, processes (`kvtopo cluster`)."""
