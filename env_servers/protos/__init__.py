"""The environment protocol (`env.proto`), the retriever's (`retriever.proto`) and their
generated gRPC stubs.

Import the stubs as `from env_servers.protos import env_pb2, env_pb2_grpc` (and
`retriever_pb2`, `retriever_pb2_grpc`). They are generated from the .proto files by
`python -m env_servers.protos.build` (run by `make venv`); importing this package
regenerates them first when they are missing or older than their .proto, so a fresh clone
works without a build step.
"""

from env_servers.protos import codegen as _codegen

_codegen.ensure_generated()

# Bumped when a change to env.proto is not backwards compatible; servers report it in
# Describe and the client pool refuses a server with another major version.
PROTOCOL_VERSION = "1.0"
SERVICE_NAME = "hgpo_jax.env.v1.Env"
# Trailing-metadata key a server sets when the env itself raised outside a slot's
# reset/step (status INTERNAL): the client raises at once instead of restarting it.
ENV_ERROR_METADATA = "hgpo-env-error"
