"""gRPC/protobuf contracts. Sources live in proto/src, generated stubs in proto/gen."""
