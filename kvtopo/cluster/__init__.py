"""The local Kubernetes control plane: binaries, certificates, processes (`kvtopo cluster`).

Reading order:

1. :mod:`~kvtopo.cluster.local_cluster` - :class:`LocalCluster` (``up(tier)``, ``down()``,
   ``with``), the state file and :func:`stop_cluster`; what tiers a and b are.
2. :mod:`~kvtopo.cluster.components` - every component's flags (loopback only).
3. :mod:`~kvtopo.cluster.binaries` - where the binaries come from (``KUBEBUILDER_ASSETS``,
   then the version-keyed cache that ``make toolchain`` fills).
4. :mod:`~kvtopo.cluster.pki` - the CA, certificates and kubeconfigs.
5. :mod:`~kvtopo.cluster.processes` - process groups, log files, stopping for good.
6. :mod:`~kvtopo.cluster.fake_nodes` - kwok's fake Nodes, its vendored Stages
   (``kwok-stages.yaml``) and the placement pods need to land on them.
7. :mod:`~kvtopo.cluster.admin_api`, :mod:`~kvtopo.cluster.deadlines` - readiness probes.
8. :mod:`~kvtopo.cluster.cli` (``kvtopo cluster up|down|env``) and
   :mod:`~kvtopo.cluster.pytest_fixtures` (``cluster_a``, ``cluster_b``).
"""
