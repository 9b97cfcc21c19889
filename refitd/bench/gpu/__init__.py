"""`refitd bench gpu`: the command, its device checks and its kernel timings."""
