# syntax=docker/dockerfile:1
#
# One image for the operator and for every stage of an InferenceService:
#   docker build -t tokenline .
#   docker run --gpus all -p 8000:8000 --read-only --tmpfs /tmp \
#     tokenline serve --model Qwen/Qwen2.5-0.5B-Instruct
#
# The base is NVIDIA's CUDA runtime (no compiler, no headers); torch comes from the PyTorch
# CUDA wheel index. Both stages share the base so the copied virtualenv finds the same
# Python. Build args pick another CUDA: --build-arg CUDA_BASE=... --build-arg TORCH_INDEX=...

ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=torch
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tokenline
ENV PATH=/opt/tokenline/bin:$PATH
# torch first and on its own: the largest layer, and the one that changes least.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY operator ./operator
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . \
    && python -c "import torch, tokenline, tokenline_operator; print('torch', torch.__version__)"

FROM ${CUDA_BASE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 tokenline \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/tokenline \
        --shell /usr/sbin/nologin tokenline \
    && mkdir -p /var/cache/tokenline \
    && chown 10001:10001 /var/cache/tokenline
COPY --from=build /opt/tokenline /opt/tokenline
ENV PATH=/opt/tokenline/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/var/cache/tokenline/huggingface
# DL3064 reads "TOKEN" in TOKENLINE_ as a secret; it is the project's flag prefix.
# hadolint ignore=DL3064
ENV TOKENLINE_MODEL_CACHE_DIR=/var/cache/tokenline
# torch.compile's caches default to $HOME and /tmp; the image runs with a read-only root
# (docker run --read-only --tmpfs /tmp), so they go to the cache volume too. The operator's
# pods give them a volume of their own.
ENV TORCHINDUCTOR_CACHE_DIR=/var/cache/tokenline/inductor \
    TRITON_CACHE_DIR=/var/cache/tokenline/triton
# Downloaded weights and the built tiny model: mount a volume here to keep them.
VOLUME ["/var/cache/tokenline"]
# A numeric uid:gid, so Kubernetes can check runAsNonRoot without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/tokenline
# api; tokenizer, scheduler and detokenizer metrics; the operator's metrics and health.
EXPOSE 8000 8001 8002 8003 8080 8081
ENTRYPOINT ["tokenline"]
CMD ["--help"]
