"""`refitd bench faults`: the command, the kill -9 suite's cluster and its rank processes."""
