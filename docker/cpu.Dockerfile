# CPU image: the gateway and the grammar service (`gramserve gateway`, `gramserve grammar-service`).
# Build from the repository root:  docker build -f docker/cpu.Dockerfile -t gramserve:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Stage 1: build the project wheel, so tests and benchmarks stay out of the image.
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir build && python -m build --wheel --outdir /wheels .

FROM ${PYTHON_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# torch first, from the CPU index: PyPI's Linux wheel is the CUDA build (gigabytes of GPU
# libraries these processes never load). torch==2.13.0+cpu satisfies the project's
# torch==2.13.0 pin, so the project install below keeps it.
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels
# TLS exec probe (kubelet's native gRPC probe is plaintext only).
COPY docker/grpc_health_probe.py /opt/gramserve/grpc_health_probe.py
# Non-root; the chart mounts /tmp writable and keeps the root filesystem read-only.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp gramserve
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["gramserve"]
CMD ["--help"]
