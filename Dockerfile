# fencepost coordinator. The database lives on the /data volume.
FROM python:3.11-slim

# Listening on 0.0.0.0 is what makes a published port reachable, and a
# plaintext port that others can reach lets any client hold or fence any lease.
# So the image does not choose plaintext for you: it starts only with TLS
# (mount certificates and set FENCEPOST_TLS_CERT, FENCEPOST_TLS_KEY and, for
# mutual TLS with owners bound to client certificates, FENCEPOST_CLIENT_CA),
# or with FENCEPOST_ALLOW_INSECURE=1 when the network is yours alone
# (`docker run -p 127.0.0.1:50051:50051 -e FENCEPOST_ALLOW_INSECURE=1 ...`).
# Without either it exits 2 and says so (docs/SECURITY.md). Health is also
# served alone in plaintext on loopback, for the image health check below.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FENCEPOST_LISTEN=0.0.0.0:50051 \
    FENCEPOST_HEALTH_LISTEN=127.0.0.1:50052 \
    FENCEPOST_DB=/data/fencepost.db

WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY clients ./clients
COPY server ./server
RUN pip install --no-cache-dir . \
    && groupadd --system --gid 10001 fencepost \
    && useradd --system --uid 10001 --gid 10001 fencepost \
    && mkdir -p /data && chown fencepost:fencepost /data

USER fencepost
VOLUME ["/data"]
# gRPC; the dashboard and /metrics (set FENCEPOST_HTTP_LISTEN=0.0.0.0:8233 to publish them)
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
