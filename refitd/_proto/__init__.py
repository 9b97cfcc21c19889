"""Generated gRPC code for protos/refitd/v1 (scripts/gen_protos.sh)."""
