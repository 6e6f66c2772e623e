# syntax=docker/dockerfile:1
#
# One image for the operator and for every stage of an InferenceService:
#   docker build -t tokenline .
#   docker run --gpus all -p 8000:8000 --read-only --tmpfs /tmp \
#     tokenline serve --model Qwen/Qwen2.5-0.5B-Instruct
#
# The base is NVIDIA's CUDA runtime; torch comes from the PyTorch CUDA wheel index. The last
# stage carries a C compiler, Python's headers and torch's: torch.compile builds kernels when
# they are first used (Triton's launcher on a GPU, inductor's C++ on a CPU), which the default
# attention backend (flex, compiled) and --compile need at run time. Both stages share the base so the copied virtualenv finds the same
# Python. Build args pick another CUDA: --build-arg CUDA_BASE=... --build-arg TORCH_INDEX=...
#
# The CPU variant (`make image`, what the tests build and run) swaps the base for a plain
# Debian and installs every Python package, the CPU torch wheel included, from a local
# wheelhouse mounted for the build only, without any index:
#   buildah build --isolation=chroot --network=host -v WHEELHOUSE:/wheels:ro \
#     --build-arg CUDA_BASE=localhost/tokenline-base:bookworm --build-arg WHEELS=/wheels \
#     --build-arg TORCH_SPEC=torch==2.13.0 -t tokenline:cpu .
# Index URLs, credentials and CA bundles never enter a layer or the build args: the
# wheelhouse is filled beforehand, on the host, with the host's pip settings.

ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=torch
# Empty: pip reads the indexes. A directory mounted at build time: pip reads only that.
ARG WHEELS=
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
RUN if [ -n "${WHEELS}" ]; then \
        pip install --no-cache-dir --no-index --find-links "${WHEELS}" "${TORCH_SPEC}"; \
    else \
        pip install --no-cache-dir --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"; \
    fi
WORKDIR /src
# The dependencies next, from pyproject.toml alone, so a change to the code reuses this
# layer (and the final stage's copy of it).
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" >requirements.txt \
    && if [ -n "${WHEELS}" ]; then \
        pip install --no-cache-dir --no-index --find-links "${WHEELS}" -r requirements.txt; \
    else \
        pip install --no-cache-dir -r requirements.txt; \
    fi
# NIXL moves KV between prefill and decode pods (--kv-transfer-config). Its wheel names an
# unpinned torch, so only its own libraries are installed. The CPU variant (a wheelhouse) has
# no NIXL: its pods refuse --kv-transfer-config at start, saying so.
RUN if [ -z "${WHEELS}" ]; then pip install --no-cache-dir --no-deps "nixl-cu12==1.5.1"; fi
COPY README.md ./
COPY services ./services
COPY operator ./operator
# hadolint ignore=DL3013
RUN if [ -n "${WHEELS}" ]; then \
        pip wheel --no-cache-dir --no-deps --no-index --find-links "${WHEELS}" --wheel-dir /dist .; \
    else \
        pip wheel --no-cache-dir --no-deps --wheel-dir /dist .; \
    fi

FROM ${CUDA_BASE}
ENV DEBIAN_FRONTEND=noninteractive
# The compilers build Python extensions and shared objects only: Python's static library,
# the packages' documentation and the downloaded archives are left out.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc g++ libc6-dev \
        ca-certificates \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
        /usr/lib/python3*/config-*/libpython3*.a /usr/share/doc/* /usr/share/man/* \
    && groupadd --system --gid 10001 tokenline \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/tokenline \
        --shell /usr/sbin/nologin tokenline \
    && mkdir -p /var/cache/tokenline \
    && chown 10001:10001 /var/cache/tokenline
ENV PATH=/opt/tokenline/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/var/cache/tokenline/huggingface
COPY --from=build /opt/tokenline /opt/tokenline
# The project itself: small layers of their own on top of the dependencies'. (A COPY, not
# a bind mount: buildah's layer cache would not see a changed wheel behind a mount.)
COPY --from=build /dist /tmp/dist
RUN pip install --no-cache-dir --no-deps --no-index /tmp/dist/tokenline-*.whl \
    && rm -rf /tmp/dist \
    && python -c "import torch, tokenline, tokenline_operator; print('torch', torch.__version__)"
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
# No HEALTHCHECK: Kubernetes ignores it; the pods' probes are /ready and /health on the
# api's port, /metrics on each other stage's, and /healthz on the operator's health port.
EXPOSE 8000 8001 8002 8003 8080 8081
ENTRYPOINT ["tokenline"]
CMD ["--help"]
