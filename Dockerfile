# One image for every meshtune container: the coordinator, the one-shot migration, the Ray head and the
# Ray workers (Ray needs the same Ray and Python versions on every node of a cluster).
#   docker build -t meshtune .                                          # CUDA build of torch (GPU workers)
#   docker build -t meshtune --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    MESHTUNE_HOME=/var/lib/meshtune

WORKDIR /opt/meshtune
# torch first and on its own layer: it is by far the largest and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY tuner ./tuner
COPY workers ./workers
COPY api ./api
COPY migrations ./migrations
RUN pip install . \
    && useradd --create-home --uid 1000 meshtune \
    && mkdir -p "${MESHTUNE_HOME}" && chown meshtune "${MESHTUNE_HOME}"

USER meshtune
EXPOSE 8000
CMD ["meshtune", "serve", "--host", "0.0.0.0", "--port", "8000"]
