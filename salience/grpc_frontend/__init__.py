"""The Salience proto over grpcio (docs/grpc.md): a thin frontend on the core.

service.py serves the seed's salience.v1.Salience, extensions.py salience.ext.v1's additions and
chat.py chat in sessions; auth.py checks tokens and scopes in an interceptor; status_codes.py maps
Salience's errors to gRPC status codes; server.py builds the server with health checking and
reflection. client.py (with the sans-IO ledger.py) is a Python client that tracks a session's length;
error_fields.py reads the request field a client's error names.
"""
