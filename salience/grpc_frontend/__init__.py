"""grpc_frontend"""
