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
    && useradd --system --uid 10001 fencepost \
    && mkdir -p /data && chown fencepost /data

USER fencepost
VOLUME ["/data"]
EXPOSE 50051

HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=2); sys.exit(0 if s.status == h.HealthCheckResponse.SERVING else 1)"]

# SIGTERM drains in-flight calls and closes the database cleanly.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fencepost", "serve"]
