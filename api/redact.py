"""What an error answer, a CLI error line or a log line may show of a value that can carry a secret:
one masking rule for every one of them (the API's exception handlers, the dashboard's messages, the
CLI's error line, the settings' errors and the log handlers of ``meshtune serve``).

URLs keep scheme, host and port (http(s) nothing after the host, others their user and path),
passwords and queries are masked, in text too; known secrets (``add_secrets``) are ``***``;
``redact`` walks dicts and lists. The rule in full: docs/api.md#redaction.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import quote, unquote, urlsplit

# Schemes whose path or user name may be the secret (webhooks): shown up to the host only.
_HOST_ONLY = frozenset({"http", "https", "ws", "wss", "ftp", "ftps"})
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*"
_URL = re.compile(rf"(?<![A-Za-z0-9+.-]){_SCHEME}://[^\s'\"<>`]*[^\s'\"<>`.,;:)\]}}]")
_ENCODED_URL = re.compile(rf"(?<![A-Za-z0-9+.-]){_SCHEME}%3A%2F%2F[^\s'\"<>`&]*", re.IGNORECASE)
_MIN_SECRET = 4  # shorter "secrets" would mask ordinary words
_secrets: frozenset[str] = frozenset()


def add_secrets(*values: str | None) -> None:
    """Remember values that no error answer or log line may show (tokens, a database password)."""
    global _secrets
    new = {v for v in values if isinstance(v, str) and len(v) >= _MIN_SECRET}
    if not new <= _secrets:
        _secrets = _secrets | new


def mask_url(url: str | None) -> str | None:
    """``url`` with its secrets masked (the module's rule); ``…`` alone for text that is not a URL
    with a host (it may be a secret pasted alone). None and "" are returned as they are."""
    if not url:
        return url
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
        user = parts.username
        shown = parts.netloc.rpartition("@")[2]  # the host as written (hostname is lower-cased)
        shown = shown[1:shown.find("]")] if shown.startswith("[") else shown.partition(":")[0]
        host = shown if shown.lower() == host else host
    except ValueError:  # an unbalanced IPv6 bracket
        return "…"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port out of range or not a number: not shown
        port = ""
    scheme = parts.scheme.lower()
    if not scheme:
        return "…"
    if not host and scheme not in _HOST_ONLY and not parts.path:  # sqlite:// (in memory)
        return f"{parts.scheme}://"
    if not host and (scheme in _HOST_ONLY or not parts.path):
        return "…"
    if ":" in host:
        host = f"[{host}]"
    if scheme in _HOST_ONLY:
        return f"{parts.scheme}://{host}{port}/…"
    auth = ""
    if user is not None:
        auth = f"{quote(unquote(user), safe='')}{':***' if parts.password is not None else ''}@"
    query = "?…" if parts.query else ""
    return f"{parts.scheme}://{auth}{host}{port}{parts.path}{query}"


def _encoded(match: re.Match[str]) -> str:
    masked = mask_url(unquote(match.group(0))) or ""
    return quote(masked, safe="…")


def redact_text(text: str) -> str:
    """``text`` with every URL in it masked and every known secret replaced by ``***``."""
    if "://" in text:
        text = _URL.sub(lambda m: mask_url(m.group(0)) or "", text)
    if "%3a%2f%2f" in text.lower():
        text = _ENCODED_URL.sub(_encoded, text)
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, "***")
    return text


def redact(value: Any) -> Any:
    """``value`` (text, or dicts and lists of them) as an error answer may show it."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact(k) if isinstance(k, str) else k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


class RedactFilter(logging.Filter):
    """A handler filter: the record's message and traceback are formatted, then masked (so what the
    handler writes never holds a URL's secret or a known token, whichever logger it came from)."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        # The arguments are masked one by one, not merged into the message: a handler's formatter may
        # read them (uvicorn's access formatter unpacks client, method, path, version and status).
        # With arguments the message is a format string of the code (``"%s://%s:%d"`` is no URL).
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(_arg(a) for a in record.args)
        elif isinstance(record.args, dict) and record.args:
            record.args = {k: _arg(v) for k, v in record.args.items()}
        elif isinstance(record.msg, str):
            record.msg = redact_text(record.msg)
        elif record.msg is not None:
            record.msg = _arg(record.msg)
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
            record.exc_info = None  # the formatter appends exc_text as it is
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def _arg(value: Any) -> Any:
    """A log argument masked: text as text; an object (an exception) only when its text holds something
    to mask, then as that masked text."""
    if isinstance(value, str):
        return redact_text(value)
    if value is None or isinstance(value, (int, float, bool)):
        return value
    text = str(value)
    masked = redact_text(text)
    return value if masked == text else masked


def install_log_filter(*loggers: logging.Logger) -> None:
    """Put ``RedactFilter`` on every handler of ``loggers`` (default: the root logger and uvicorn's)."""
    for logger in loggers or (logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error"),
                              logging.getLogger("uvicorn.access")):
        for handler in logger.handlers:
            if not any(isinstance(f, RedactFilter) for f in handler.filters):
                handler.addFilter(RedactFilter())
