# fencepost coordinator. The database lives on the /data volume.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FENCEPOST_LISTEN=0.0.0.0:50051 \
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

# `fencepost health` connects to the port of FENCEPOST_LISTEN: set the address
# there (not with --listen) and the check follows it.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["fencepost", "health", "--timeout", "2"]

# SIGTERM drains in-flight calls and closes the database cleanly.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fencepost", "serve"]
