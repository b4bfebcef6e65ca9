"""API keys: `Authorization: Bearer <key>` on the API routes, as OpenAI's clients send it.

Keys come from `--api-key` (repeatable) and the environment variable DDTREE_API_KEY (several
separated by commas), which keeps them out of process lists. A key is compared with every
configured key in constant time (hmac.compare_digest, and no early exit), and never logged or
echoed. The gate is plain ASGI middleware, so streaming responses and disconnect detection pass
through it untouched.
"""

from __future__ import annotations

import hmac
import json
import os

ENV_VAR = "DDTREE_API_KEY"


def api_keys(given: list[str] | None, environ=os.environ) -> tuple[str, ...]:
    """The configured keys: those given, then those in $DDTREE_API_KEY (comma-separated, empty
    entries skipped); an empty or blank --api-key is refused (it would let `Bearer ` through)."""
    keys = list(given or []) + [k.strip() for k in environ.get(ENV_VAR, "").split(",") if k.strip()]
    if any(not k or any(c.isspace() for c in k) for k in keys):
        raise ValueError(f"an API key must be non-empty and hold no whitespace (--api-key, ${ENV_VAR})")
    return tuple(dict.fromkeys(keys))


class KeyCheck:
    def __init__(self, keys: tuple[str, ...]):
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: bytes | None) -> bool:
        """Whether an Authorization header value carries one of the keys."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for key in self._keys:  # every key, whatever matched: the time does not tell which one
            ok |= hmac.compare_digest(token, key)
        return ok


class KeyGate:
    """ASGI middleware: HTTP requests to a guarded path without a valid key get 401 (OpenAI's
    error body, code invalid_api_key, WWW-Authenticate: Bearer); on_refused(path) is called for
    each (the server counts them)."""

    def __init__(self, app, check: KeyCheck, guarded, on_refused):
        self.app, self.check, self.guarded, self.on_refused = app, check, guarded, on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.guarded(scope["path"]):
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.check.allows(header):
            return await self.app(scope, receive, send)
        self.on_refused(scope["path"])
        message = ("no API key: send 'Authorization: Bearer <key>'" if header is None
                   else "the API key is not valid for this server")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
