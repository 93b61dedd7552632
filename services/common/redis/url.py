"""Redis URLs: the credentials in them, how to show them, and the errors that mean "wrong
credentials" rather than "Redis is down".

Every Redis client in Tandem is built from one `redis_url`, in redis-py's forms:

    redis://[[user]:password@]host[:port][/db]          plain TCP
    rediss://[[user]:password@]host[:port][/db][?ssl_ca_certs=/ca.pem&...]   TLS
    unix://[[user]:password@]/path/redis.sock[?db=N]    unix socket
    ...?password=PASS                                   the password as a query parameter

Passwords are percent-encoded in the userinfo (`with_credentials` does it). A URL that may
hold a password is never logged or put in an error as it is: `redact_url` first.
"""

from __future__ import annotations

from urllib.parse import quote, unquote, urlsplit, urlunsplit

from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    RedisError,
)

_REDACTED = "***"
_SECRET_QUERY_KEYS = frozenset({"password", "ssl_password"})

# Redis refused who we are or what we may do: NOAUTH (no password sent), WRONGPASS, an ACL's
# NOPERM. Retrying does not help, unlike a connection error.
AUTH_ERRORS: tuple[type[RedisError], ...] = (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
)


class RedisAuthError(RuntimeError):
    """Redis refused the credentials in a `redis_url`: a configuration error, raised at a
    service's start-up instead of retrying forever."""

    @classmethod
    def of(cls, url: str, exc: BaseException) -> RedisAuthError:
        reason = auth_error(exc) or exc
        return cls(
            f"Redis at {redact_url(url)} refused our credentials ({type(reason).__name__}: "
            f"{reason}); check the password (and ACL user) in redis_url / TANDEM_REDIS_URL"
        )


def auth_error(exc: BaseException) -> BaseException | None:
    """The AUTH_ERRORS member in `exc`'s chain (redis.asyncio raises a ConnectionError
    caused by the AuthenticationError), or None when Redis did not refuse credentials."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, AUTH_ERRORS):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def is_auth_error(exc: BaseException) -> bool:
    return auth_error(exc) is not None


def redact_url(url: str) -> str:
    """`url` with its password (userinfo or `password=` query parameter) replaced by ***;
    the user name, host, path and other parameters stay, so the URL still says where."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{_REDACTED}@{host}" if colon else f"{user}@{host}"
    query = "&".join(
        f"{item.split('=', 1)[0]}={_REDACTED}"
        if unquote(item.split("=", 1)[0]) in _SECRET_QUERY_KEYS
        else item
        for item in parts.query.split("&")
    )
    # Not urlunsplit: it drops the empty authority of `unix:///path`.
    out = f"{parts.scheme}://{netloc}{parts.path}"
    out += f"?{query}" if parts.query else ""
    return out + (f"#{parts.fragment}" if parts.fragment else "")


def with_credentials(url: str, password: str, username: str = "") -> str:
    """`url` with `[username]:password@` as its userinfo (replacing any), percent-encoded:
    `with_credentials("unix:///run/r.sock", "p@ss")` -> `unix://:p%40ss@/run/r.sock`."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    userinfo = f"{quote(username, safe='')}:{quote(password, safe='')}"
    return urlunsplit((parts.scheme, f"{userinfo}@{host}", parts.path, parts.query, parts.fragment))
