"""`refitd bench load`: the command and its metadata peers."""
