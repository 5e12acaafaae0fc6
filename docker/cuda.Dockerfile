# CUDA image: the worker groups (`gramserve worker-group --device cuda`).
# Build from the repository root:  docker build -f docker/cuda.Dockerfile -t gramserve-cuda:0.1.0 .
#
# Base: nvidia/cuda "base" (CUDA runtime API library and the NVIDIA container toolkit's
# settings, NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES, nothing else). The CUDA build
# of torch brings its own cuBLAS, cuDNN and NCCL as nvidia-* wheels, so the larger "runtime"
# and "devel" bases would only add a second copy. The base's CUDA version must be the one
# the torch wheel is built for (TORCH_INDEX) and no newer than the nodes' driver supports.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN python3 -m venv /tmp/b && /tmp/b/bin/pip install --no-cache-dir build \
    && /tmp/b/bin/python -m build --wheel --outdir /wheels .

FROM ${CUDA_IMAGE}
# The CUDA variant of torch 2.13.0 that matches CUDA_IMAGE (cu128 = CUDA 12.8).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH
# Triton compiles a small C launcher per kernel at first use: it needs a C compiler and the
# Python headers at run time, not only at build time.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
# torch first, from the CUDA index: torch==2.13.0+cu128 satisfies the project's torch==2.13.0
# pin (a local version label matches a pin without one), so the project install keeps it
# instead of replacing it with the CPU build.
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels \
    && python -c "import torch; assert torch.version.cuda, 'torch is not the CUDA build'"
COPY docker/grpc_health_probe.py /opt/gramserve/grpc_health_probe.py
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp gramserve
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["gramserve"]
CMD ["--help"]
