# The LMSP service image. Every container of docker-compose.yml runs it: web
# (the default command), the workers, beat and the init step.
#
# Base: NVIDIA's CUDA runtime with cuDNN. onnxruntime-gpu 1.31 is built for
# CUDA 13.0 and cuDNN 9 (its CUDA provider links libcudart.so.13 and
# libcublas.so.13), so the base is a CUDA 13.0 runtime image with cuDNN 9.
# The same image serves the CPU-only profile: without a GPU, LMSP_DEVICE=cpu.
#
# Python 3.11 on Ubuntu 24.04 (which ships 3.12): uv installs a standalone
# CPython 3.11 build (python-build-standalone: relocatable, needs nothing but
# glibc from the system) in a build stage, creates /app/.venv from it and
# installs the pinned requirements.txt. The final stage copies only the
# interpreter and the venv, so neither uv nor a PPA ends up in the image, and
# pinning the uv image pins the exact Python patch release.
ARG CUDA_IMAGE=nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.8

FROM ${UV_IMAGE} AS uv

FROM ${CUDA_IMAGE} AS build
ARG PYTHON_VERSION=3.11
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_NO_CACHE=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy
WORKDIR /app
COPY requirements.txt ./
RUN uv python install "${PYTHON_VERSION}" \
 && uv venv --python "${PYTHON_VERSION}" /app/.venv \
 && uv pip install --python /app/.venv/bin/python -r requirements.txt

FROM ${CUDA_IMAGE}
# tini as PID 1 reaps zombies and, with -g, passes SIGTERM to the whole
# process group: a Celery worker takes no new task, lets its running tasks go
# on for LMSP_DRAIN_SECONDS and hands each one left back by its restart
# policy (docker-compose.yml, x-lmsp-worker).
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 lmsp \
 && useradd --system --uid 10001 --gid lmsp --home-dir /app --no-create-home --shell /usr/sbin/nologin lmsp \
 && mkdir -p /data /models \
 && chown lmsp:lmsp /data /models
COPY --from=build /opt/python /opt/python
COPY --from=build /app/.venv /app/.venv
WORKDIR /app
# The code belongs to root and stays read-only for the service user; what the
# service writes goes to /data and /models (volumes in docker-compose.yml,
# which take this ownership when Docker first fills them).
COPY . /app
RUN /app/.venv/bin/python -m compileall -q lmsp_project tasks_app workers fixture_models
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LMSP_DATA_DIR=/data \
    LMSP_MODELS_DIR=/models
USER lmsp
EXPOSE 8000
# Fits the default command (web); docker-compose.yml gives the workers and
# beat a check of their own and switches it off for init.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/lmsp/v1/capabilities', timeout=5)"]
ENTRYPOINT ["/usr/bin/tini", "-g", "--"]
CMD ["uvicorn", "lmsp_project.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--no-access-log", "--lifespan", "off", "--timeout-graceful-shutdown", "10"]
