"""fencepost coordinator server."""


def version() -> str:
    """The installed fencepost version ("unknown" in a bare source tree)."""
    from importlib import metadata

    try:
        return metadata.version("fencepost")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"
