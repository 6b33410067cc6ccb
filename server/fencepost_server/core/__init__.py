"""The pure core: records, lifecycle and decisions. Imports no asyncio, grpc or sqlite3."""
