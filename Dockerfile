# fencepost coordinator. The database lives on the /data volume.
#
# Built from Debian 12: the registry's debian:bookworm-slim where one is
# reachable (`docker build -t fencepost .`), or a root filesystem made by
# debootstrap from Debian's own packages (`make image`: scripts/build_image.sh
# passes it as BASE). Everything after FROM is the same either way.
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS build
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv ca-certificates \
    && apt-get clean && rm -rf /var/lib/apt/lists/*
COPY clients/python /src/clients/python
COPY server /src/server
# The two distributions, as `pip install fencepost-server` would install them.
# Behind a proxy that re-signs TLS, pass its CA bundle as the build secret
# "cacert" (`--secret id=cacert,src=FILE`); without one pip trusts its own.
RUN --mount=type=secret,id=cacert \
    if [ -f /run/secrets/cacert ]; then export PIP_CERT=/run/secrets/cacert; fi \
    && python3 -m venv /opt/fencepost \
    && /opt/fencepost/bin/pip install --no-cache-dir /src/clients/python /src/server \
    && /opt/fencepost/bin/pip uninstall --yes setuptools pip

FROM ${BASE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 fencepost \
    && useradd --system --uid 10001 --gid 10001 --home-dir /data --no-create-home fencepost \
    && mkdir -p /data && chown fencepost:fencepost /data
COPY --from=build /opt/fencepost /opt/fencepost

# Listening on 0.0.0.0 is what makes a published port reachable, and a
# plaintext port that others can reach lets any client hold or fence any lease.
# So the image does not choose plaintext for you: it starts only with TLS
# (mount certificates and set FENCEPOST_TLS_CERT, FENCEPOST_TLS_KEY and, for
# mutual TLS with owners bound to client certificates, FENCEPOST_CLIENT_CA),
# or with FENCEPOST_ALLOW_INSECURE=1 when the network is yours alone
# (`docker run -p 127.0.0.1:50051:50051 -e FENCEPOST_ALLOW_INSECURE=1 ...`).
# Without either it exits 2 and says so (docs/SECURITY.md). Health is also
# served alone in plaintext on loopback, for the image health check below.
ENV PATH=/opt/fencepost/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FENCEPOST_LISTEN=0.0.0.0:50051 \
    FENCEPOST_HEALTH_LISTEN=127.0.0.1:50052 \
    FENCEPOST_DB=/data/fencepost.db

WORKDIR /data
USER fencepost
VOLUME ["/data"]
# gRPC; the dashboard and /metrics (set FENCEPOST_HTTP_LISTEN=0.0.0.0:8233 to publish them:
# like gRPC it needs TLS or FENCEPOST_ALLOW_INSECURE=1, and it answers Host names other
# than localhost only when they are in FENCEPOST_HTTP_ALLOWED_HOSTS)
EXPOSE 50051 8233

# `fencepost health` asks the plaintext health-only port of
# FENCEPOST_HEALTH_LISTEN when it is set (no client certificate needed beside
# mutual TLS), else the port of FENCEPOST_LISTEN: set addresses there (not
# with --listen) and the check follows them.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["fencepost", "health", "--timeout", "2"]

# SIGTERM drains in-flight calls and closes the database cleanly.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fencepost", "serve"]
