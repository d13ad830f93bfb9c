"""Client config resolution (flags > env > file > default) and the 0600 config file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gpufleet.cli.config import (
    DEFAULT_URL,
    ClientConfig,
    ConfigError,
    default_config_path,
    require_token,
    resolve_client_config,
    write_client_config,
)


class TestResolveClientConfig:
    @pytest.mark.parametrize(
        ("flags", "env", "file", "want_url", "want_token"),
        [
            pytest.param({}, {}, None, DEFAULT_URL, None, id="nothing set: default url, no token"),
            pytest.param(
                {}, {}, {"url": "http://f:1", "token": "ft"}, "http://f:1", "ft", id="file only"
            ),
            pytest.param(
                {},
                {"GPUFLEET_URL": "http://e:2", "GPUFLEET_TOKEN": "et"},
                {"url": "http://f:1", "token": "ft"},
                "http://e:2",
                "et",
                id="env beats file",
            ),
            pytest.param(
                {"url": "http://x:3/", "token": "xt"},
                {"GPUFLEET_URL": "http://e:2", "GPUFLEET_TOKEN": "et"},
                {"url": "http://f:1", "token": "ft"},
                "http://x:3",
                "xt",
                id="flags beat env; trailing slash dropped",
            ),
            pytest.param(
                {"url": "http://x:3"},
                {},
                {"url": "http://f:1", "token": "ft"},
                "http://x:3",
                "ft",
                id="per field: url flag, token from file",
            ),
            pytest.param(
                {},
                {"GPUFLEET_TOKEN": "et"},
                {"url": "http://f:1"},
                "http://f:1",
                "et",
                id="per field: token from env, url from file",
            ),
        ],
    )
    def test_order(
        self,
        tmp_path: Path,
        flags: dict[str, str],
        env: dict[str, str],
        file: dict[str, str] | None,
        want_url: str,
        want_token: str | None,
    ) -> None:
        path = tmp_path / "client.yaml"
        if file is not None:
            write_client_config(path, file.get("url", ""), file.get("token", ""))
        cfg = resolve_client_config(**flags, env={**env, "GPUFLEET_CONFIG": str(path)})
        assert cfg == ClientConfig(url=want_url, token=want_token)

    def test_file_locations(self, tmp_path: Path) -> None:
        assert default_config_path({"GPUFLEET_CONFIG": "/a/b.yaml"}) == Path("/a/b.yaml")
        assert default_config_path({"GPUFLEET_DATA_DIR": "/d"}) == Path("/d/client.yaml")
        assert default_config_path({}) == Path("~/.gpufleet/client.yaml").expanduser()

    def test_data_dir_file_is_read(self, tmp_path: Path) -> None:
        write_client_config(tmp_path / "client.yaml", "http://d:9", "dt")
        cfg = resolve_client_config(env={"GPUFLEET_DATA_DIR": str(tmp_path)})
        assert cfg == ClientConfig(url="http://d:9", token="dt")

    @pytest.mark.parametrize(
        "text", [pytest.param("url: [unclosed", id="bad yaml"), pytest.param("- 1", id="a list")]
    )
    def test_bad_file_is_a_config_error(self, tmp_path: Path, text: str) -> None:
        path = tmp_path / "client.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=str(path)):
            resolve_client_config(env={"GPUFLEET_CONFIG": str(path)})

    def test_missing_token_tells_the_user_what_to_do(self) -> None:
        with pytest.raises(ConfigError, match=r"gpufleet up.*GPUFLEET_TOKEN"):
            require_token(ClientConfig(url=DEFAULT_URL, token=None))


class TestWriteClientConfig:
    def test_mode_0600_even_over_a_looser_file(self, tmp_path: Path) -> None:
        path = tmp_path / "sub" / "client.yaml"
        path.parent.mkdir()
        path.write_text("old")
        path.chmod(0o644)
        write_client_config(path, "http://h:1", "secret")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        got = resolve_client_config(env={"GPUFLEET_CONFIG": str(path)})
        assert got == ClientConfig(url="http://h:1", token="secret")


class TestTransportSecurity:
    @pytest.mark.parametrize(
        ("url", "warned"),
        [
            ("http://127.0.0.1:8420", False),
            ("http://localhost:8420", False),
            ("http://[::1]:8420", False),
            ("https://api.example.com", False),
            ("http://api.example.com:8420", True),
            ("http://10.0.0.5:8420", True),
        ],
    )
    def test_plain_http_to_another_host_is_warned(self, url: str, warned: bool) -> None:
        from gpufleet.client.config import cleartext_warning

        assert (cleartext_warning(url) is not None) is warned

    def test_the_ca_bundle_comes_from_the_env_then_the_file(self, tmp_path: Path) -> None:
        cfg = tmp_path / "client.yaml"
        cfg.write_text("url: https://h:1\ntoken: t\nca_bundle: /etc/file-ca.pem\n")
        env = {"GPUFLEET_CONFIG": str(cfg)}
        assert resolve_client_config(env=env).ca_bundle == "/etc/file-ca.pem"
        env["GPUFLEET_CA_BUNDLE"] = "/etc/env-ca.pem"
        assert resolve_client_config(env=env).ca_bundle == "/etc/env-ca.pem"

    def test_an_unreadable_ca_bundle_is_a_config_error(self, tmp_path: Path) -> None:
        from gpufleet.client._core import tls_verify

        with pytest.raises(ConfigError, match="CA bundle"):
            tls_verify("https://h:1", str(tmp_path / "missing.pem"))
