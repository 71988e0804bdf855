# syntax=docker/dockerfile:1
#
# The LLM sidecar image (distribution llm-circuit-sidecar, command `sidecar`).
#
#   docker build -t llm-circuit-sidecar:0.1.0 .
#   docker run --rm -p 9090:9090 -p 8080:8080 \
#     -v "$PWD/deploy/k8s/sidecar.toml:/etc/sidecar/sidecar.toml:ro" \
#     -e SIDECAR__SERVER__LISTEN=0.0.0.0:8080 \
#     -e OPENAI_API_KEY -e ANTHROPIC_API_KEY llm-circuit-sidecar:0.1.0
#
# Stage 1 builds the project wheel and a virtualenv with every dependency;
# stage 2 copies only that virtualenv onto a clean slim image: no compilers, no
# pip cache, no source tree, no secrets (keys come from the environment at run
# time). Both stages use the same base so the venv's interpreter path matches.
# The tag pins the Python patch release and the Debian release; append
# @sha256:<digest> to pin the exact image as well.

FROM python:3.11.14-slim-bookworm AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src

# The build context is allow-listed by .dockerignore: pyproject.toml, README.md,
# LICENSE, requirements.lock and the sidecar package only.
COPY . .

# Dependencies come from requirements.lock, exact versions with their sha256
# hashes (pip-compile over pyproject.toml; docs/kubernetes.md says how to
# refresh it), so two builds ship the same aiohttp; a file whose hash differs
# fails the build. The project wheel then goes in with --no-deps, and
# `pip check` fails the build when the lock no longer satisfies pyproject.toml's
# ranges. Binary wheels exist for all of them on linux/amd64 and linux/arm64, so
# no compiler is needed. The last step is a smoke test: the console script runs
# and the embedded default config (package data) made it into the wheel.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --require-hashes -r requirements.lock \
    && /opt/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels . \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
    && /opt/venv/bin/pip check \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib \
    && /opt/venv/bin/sidecar check-config > /dev/null

FROM python:3.11.14-slim-bookworm

LABEL org.opencontainers.image.title="llm-circuit-sidecar" \
      org.opencontainers.image.description="A circuit-breaking reverse-proxy sidecar for LLM APIs" \
      org.opencontainers.image.version="0.1.0"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# A fixed numeric UID/GID, so Kubernetes' runAsNonRoot can verify it and
# runAsUser: 10001 matches. No home directory, no login shell.
RUN groupadd --system --gid 10001 sidecar \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin sidecar

COPY --from=builder /opt/venv /opt/venv

USER 10001:10001

# 8080: the proxy (listens on 127.0.0.1 by default: set server.listen, e.g.
# SIDECAR__SERVER__LISTEN=0.0.0.0:8080, to publish it outside a pod);
# 9090: the admin port (/metrics, /healthz, /readyz, /status).
EXPOSE 8080 9090

# For `docker run` / compose; Kubernetes uses the probes in deploy/k8s instead.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9090/healthz', timeout=2)"]

# SIGTERM (Docker's and Kubernetes' stop signal) makes the sidecar drain and
# exit 0; the Python process handles it itself as PID 1.
STOPSIGNAL SIGTERM

ENTRYPOINT ["sidecar"]
CMD ["serve", "--config", "/etc/sidecar/sidecar.toml"]
