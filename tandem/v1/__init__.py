"""Generated protobuf and gRPC code for protos/tandem/v1 (do not edit; see protos/generate.py)."""
