"""serve.access without a server: loopback detection, Host / Origin allow-lists, the API
key's sources and the start-up warning."""

from __future__ import annotations

import logging

import pytest

from serve.access import HttpAccess, exposure_warning, host_name, is_loopback, resolve_api_key


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LOCALHOST", True), ("0.0.0.0", False), ("::", False),
    ("", False), ("10.0.0.5", False), ("example.com", False), ("localhost.evil.com", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8000", "localhost"), ("127.0.0.1", "127.0.0.1"), ("[::1]:8000", "::1"),
    ("[::1]", "::1"), ("Example.COM.", "example.com"), ("::1", "::1"),
])
def test_host_name_drops_port_and_brackets(header, name):
    assert host_name(header) == name


def test_a_loopback_server_answers_only_to_loopback_names():
    access = HttpAccess.build("127.0.0.1")
    for header in ("localhost:8000", "127.0.0.1:1", "[::1]:8000", "LocalHost", None):
        assert access.host_allowed(header), header
    # DNS rebinding: the attacker's name resolves to 127.0.0.1, but the Host still names it.
    for header in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "",
                   "localhost:8000@evil", "10.0.0.1"):
        assert not access.host_allowed(header), header


def test_allowed_hosts_and_origins():
    exposed = HttpAccess.build("0.0.0.0")
    assert exposed.host_allowed("anything.example:80")  # not loopback: any host by default
    assert not exposed.origin_allowed("https://app.example")  # but no browser origin
    listed = HttpAccess.build("0.0.0.0", ["api.example", "*.corp.example", "[::1]"],
                              ["https://App.example/"])
    assert listed.host_allowed("API.example:8000") and listed.host_allowed("x.corp.example")
    assert listed.host_allowed("[::1]:80")
    assert not listed.host_allowed("corp.example") and not listed.host_allowed("localhost")
    assert listed.origin_allowed("https://app.example")
    assert not listed.origin_allowed("http://app.example")
    assert not listed.origin_allowed("null")
    anything = HttpAccess.build("127.0.0.1", ["*"], ["*"])
    assert anything.host_allowed("evil.example") and anything.origin_allowed("null")


def test_api_key_sources(tmp_path, caplog):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    environ = {"JAXINFER_API_KEY": "from-env", "VLLM_API_KEY": "from-vllm"}
    assert resolve_api_key(None, None, {}) is None
    assert resolve_api_key(None, None, {"JAXINFER_API_KEY": ""}) is None
    assert resolve_api_key(None, None, environ) == "from-env"
    assert resolve_api_key(None, None, {"VLLM_API_KEY": "from-vllm"}) == "from-vllm"
    assert resolve_api_key(None, str(key_file), environ) == "from-file"
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="jaxinfer.serve"):
        assert resolve_api_key("from-flag", None, environ) == "from-flag"
    assert "ps" in caplog.text and "--api-key-file" in caplog.text
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    for flag, path, fragment in [("k", str(key_file), "not both"), (None, str(empty), "empty"),
                                 (None, str(tmp_path / "missing"), "cannot read"),
                                 ("", None, "empty")]:
        with pytest.raises(ValueError, match=fragment):
            resolve_api_key(flag, path, {})


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "key") is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and "without an API key" in warning
