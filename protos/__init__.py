"""The gramserve wire contract: .proto files, their generated modules, and gRPC plumbing.

Import generated modules as `from protos import worker_pb2, worker_pb2_grpc`.
"""
