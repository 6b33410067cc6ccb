"""``host[:port]`` as the listen flags and the dashboard's Host checks read it."""

from __future__ import annotations


def split_address(text: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` too) -> (host, port); ValueError when
    the port is not a number in 0..65535 or the host is empty."""
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] not in ("", ":"):
            raise ValueError("an IPv6 address goes in brackets: [::1]:PORT")
        host, port_text = text[: end + 1], text[end + 2 :]
    elif text.count(":") > 1:
        raise ValueError("an IPv6 address goes in brackets: [::1]:PORT")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError("the host is missing (e.g. 127.0.0.1:PORT or 0.0.0.0:PORT)")
    if port_text == "":
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"the port must be a number in 0..65535 (got {port_text!r})")
    return host, int(port_text)


def host_entry(text: str) -> tuple[str, int | None]:
    """A Host allow-list entry or a Host header, ``name[:port]`` (``[v6]:port``
    too) -> (lower-case name, port or None); ValueError when malformed."""
    t = text.strip().lower()
    if not t or len(t) > 300 or any(c in t for c in "/@?#*\\ \t"):
        raise ValueError("expected a host name or address, optionally with :PORT "
                         "(no scheme or path)")
    if t.startswith("["):
        end = t.find("]")
        if end < 2:
            raise ValueError("an IPv6 address goes in brackets: [::1]:PORT")
        host, rest = t[: end + 1], t[end + 1 :]
    elif t.count(":") > 1:
        raise ValueError("an IPv6 address goes in brackets: [::1]:PORT")
    else:
        host, sep, port_text = t.partition(":")
        rest = sep + port_text
    host = host.rstrip(".")
    if not host:
        raise ValueError("the host is missing")
    if not rest:
        return host, None
    digits = rest[1:]
    if (rest[0] != ":" or not (digits.isascii() and digits.isdigit())
            or not 0 < int(digits) <= 65535):
        raise ValueError(f"the port must be a number in 1..65535 (got {rest[1:]!r})")
    return host, int(digits)
