"""The client commands' connection to the REST API: the ``httpx.Client``, one request, the
SDK over it, and :func:`_session`, which maps every failure to a message and an exit code
(a 4xx prints the server's message and exits 2, an unreachable server or a 5xx exits 1,
Ctrl-C 130) so that no command shows a traceback.

Start-up cost: httpx and the SDK are imported inside the functions that need them, never at
module level (see :mod:`gpufleet.cli.client`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import typer

from gpufleet.cli import output
from gpufleet.cli.options import ClientError, url_problem
from gpufleet.client.config import (
    ClientConfig,
    ConfigError,
    default_config_path,
    require_token,
    resolve_client_config,
)
from gpufleet.client.errors import ApiError, GpufleetClientError, TransportError

if TYPE_CHECKING:
    import httpx

    from gpufleet.client import Client


def make_http_client(cfg: ClientConfig, transport: httpx.BaseTransport | None = None) -> Any:
    """The ``httpx.Client`` for ``cfg``: base URL, bearer token, 5 s connect / 30 s read.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport``); by default a
    plain-http URL gets :class:`gpufleet.cli.transport.StdlibTransport` (no httpcore/h11
    import), anything else httpx's own transport.

    Raises:
        ConfigError: no token is configured.
    """
    import httpx

    from gpufleet.cli import transport as stdlib_transport
    from gpufleet.client.config import cleartext_warning

    warning = cleartext_warning(cfg.url)
    if warning:
        typer.echo(f"warning: {output.clean(warning)}", err=True)
    verify: Any = True
    if transport is None and stdlib_transport.usable(cfg.url):
        transport = stdlib_transport.StdlibTransport()  # httpx never builds an SSL context
    elif transport is None:
        from gpufleet.client._core import tls_verify

        verify = tls_verify(cfg.url, cfg.ca_bundle)
    return httpx.Client(
        base_url=cfg.url,
        headers={"Authorization": f"Bearer {require_token(cfg)}", "User-Agent": "gpufleet-cli"},
        timeout=httpx.Timeout(30.0, connect=5.0),
        transport=transport,
        verify=verify,
    )


def _raise_for_error(resp: httpx.Response) -> None:
    """Turn a 4xx/5xx (already read) into the SDK's typed error (an :class:`ApiError`)."""
    if resp.status_code >= 400:
        from gpufleet.client._core import error_of

        raise error_of(resp)


def _call(http: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    """One request on the ``_session`` client; the JSON object it answers.

    Raises:
        ApiError: (a typed subclass for) an error answer.
        ClientError: the answer is not a JSON object.
    """
    resp = http.request(method, path, **kwargs)
    _raise_for_error(resp)
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ClientError(
            f"unexpected non-JSON answer from server (HTTP {resp.status_code})", exit_code=1
        )
    return data


def _sdk(http: httpx.Client) -> Client:
    """The SDK client over the ``_session``'s HTTP client."""
    from gpufleet.client import Client

    return Client(http=http)


def _auth_hint(exc: ApiError) -> str:
    if exc.status == 401:
        return " (check --token or GPUFLEET_TOKEN, or rerun `gpufleet up`)"
    return ""


def _check_url(cfg_url: str, flag: str | None) -> None:
    """Refuse a server URL that is not http(s)://host, naming where it came from (the
    ``--url`` flag, ``GPUFLEET_URL`` or the client config file).

    Raises:
        ClientError: the URL is unusable (exit 2).
    """
    problem = url_problem(cfg_url)
    if problem is None:
        return
    if flag:
        source = "--url"
    elif os.environ.get("GPUFLEET_URL"):
        source = "GPUFLEET_URL"
    else:
        source = f"url in {default_config_path()}"
    raise ClientError(f"{source} {cfg_url!r}: {problem}", field=source.split(" ")[0])


def _missing_config_note() -> str:
    """`` (GPUFLEET_CONFIG names PATH, which does not exist)`` when it does, else ``""``: the
    likely cause of a missing token or URL, which the resolution silently skipped."""
    named = os.environ.get("GPUFLEET_CONFIG")
    if named and not default_config_path().is_file():
        return f" (GPUFLEET_CONFIG names {named}, which does not exist)"
    return ""


@contextmanager
def _session(url: str | None, token: str | None) -> Iterator[httpx.Client]:
    """Resolve the config, open the HTTP client, and map every failure to a message + exit
    (4xx and bad input: 2; unreachable server or 5xx: 1; Ctrl-C: 130)."""
    import httpx

    target = url or "the configured URL"
    try:
        cfg = resolve_client_config(url, token)
        target = cfg.url
        _check_url(cfg.url, url)
        with make_http_client(cfg) as http:
            yield http
    except ClientError as exc:
        output.print_error(exc.message, exc.field)
        raise typer.Exit(exc.exit_code) from None
    except ApiError as exc:
        output.print_error(exc.message + _auth_hint(exc), exc.field)
        raise typer.Exit(2 if exc.status < 500 else 1) from None
    except ConfigError as exc:
        output.print_error(str(exc) + _missing_config_note())
        raise typer.Exit(2) from None
    except (httpx.ConnectError, httpx.ConnectTimeout):
        output.print_error(
            f"cannot reach gpufleet at {target}: is the server running? (gpufleet up)"
        )
        raise typer.Exit(1) from None
    except TransportError as exc:
        if isinstance(exc.__cause__, httpx.ConnectError | httpx.ConnectTimeout):
            output.print_error(
                f"cannot reach gpufleet at {target}: is the server running? (gpufleet up)"
            )
        else:
            output.print_error(f"request to {target} failed: {exc.message}")
        raise typer.Exit(1) from None
    except (httpx.HTTPError, GpufleetClientError) as exc:
        output.print_error(f"request to {target} failed: {exc or type(exc).__name__}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
