# syntax=docker/dockerfile:1
# Ember on NVIDIA GPUs: Hopper (sm_90) and Blackwell (sm_100, sm_120).
# Build:  docker build -t ember .
# Run:    docker run --gpus all -p 8000:8000 -v /path/to/models:/models ember /models/Qwen3-8B --host 0.0.0.0

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# ---- build: a virtual environment with a CUDA 12.8 torch (kernels for sm_90, sm_100, sm_120) and Ember ----
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS build
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ember ember
COPY server server
COPY engine engine
COPY kernels kernels
COPY parsers parsers
COPY grammar grammar
RUN pip install .

# ---- runtime: CUDA runtime, the venv, a non-root user ----
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles its small launcher with gcc and the Python headers at first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
RUN useradd --create-home --uid 1001 ember \
    && mkdir -p /models \
    && chown ember:ember /models
USER 1001:1001
ENV PATH=/opt/venv/bin:$PATH \
    EMBER_CACHE_DIR=/home/ember/.cache/ember \
    PYTHONUNBUFFERED=1
WORKDIR /home/ember
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["ember", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
