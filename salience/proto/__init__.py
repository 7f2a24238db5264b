"""Generated gRPC stubs (`make proto`) and the .proto files they come from."""
