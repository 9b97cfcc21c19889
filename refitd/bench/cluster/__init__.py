"""`refitd bench cluster`: the command and the emulated-host harness (network namespaces,
a cluster over them, the per-host worker processes) it shares with tests/multihost."""
