"""kvtopo benchmarks (`kvtopo bench ...`): the data path, the registry and the operator."""
