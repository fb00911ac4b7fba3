"""The command line: settings from flags, STREAMGROK_* variables and --config files, checked
before any model loads."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from streamgrok.cli import build_parser
from streamgrok.cli.options import POLICIES, resolve_pipeline
from streamgrok.cli.sources import apply_sources, env_name, read_config, settings, subcommands


def parsed(argv, config=None, environ=None) -> argparse.Namespace:
    parser = build_parser()
    apply_sources(parser, config or {}, environ or {})
    return parser.parse_args(argv)


def test_every_flag_has_help_an_environment_twin_and_a_shown_default():
    for path, sub in subcommands(build_parser()):
        for action in settings(sub):
            assert action.help, f"{' '.join(path)} {action.option_strings} has no help"
            assert env_name(action).startswith("STREAMGROK_")
        if path[0] != "bench" or len(path) > 1:
            assert sub.formatter_class is argparse.ArgumentDefaultsHelpFormatter, path


def test_precedence_is_flag_then_environment_then_file_then_default(tmp_path):
    assert parsed(["serve"]).kv_budget == 2048
    assert parsed(["serve"], {"kv-budget": 1024}).kv_budget == 1024
    assert parsed(["serve"], {"serve": {"kv_budget": 512}}).kv_budget == 512
    assert parsed(["serve"], {"kv-budget": 1024},
                  {"STREAMGROK_KV_BUDGET": "4096"}).kv_budget == 4096
    assert parsed(["serve", "--kv-budget", "99"], {"kv-budget": 1024},
                  {"STREAMGROK_KV_BUDGET": "4096"}).kv_budget == 99
    args = parsed(["serve"], environ={"STREAMGROK_API_KEY": "k", "STREAMGROK_ALLOW_ORIGIN":
                                      "http://a.example\nhttp://b.example"})
    assert args.api_key == "k" and args.allow_origin == ["http://a.example", "http://b.example"]
    assert parsed(["run", "x.py", "--source", "v.mp4"],
                  environ={"STREAMGROK_LIVE": "yes"}).live is True


def test_bad_settings_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="STREAMGROK_KV_POLICY.*invalid choice 'bogus'"):
        parsed(["serve"], environ={"STREAMGROK_KV_POLICY": "bogus"})
    with pytest.raises(ValueError, match="STREAMGROK_PORT.*invalid literal"):
        parsed(["serve"], environ={"STREAMGROK_PORT": "eighty"})
    with pytest.raises(ValueError, match="unknown settings: kv-budgte, serve.nope"):
        parsed(["serve"], {"kv-budgte": 1, "serve": {"nope": 2}})
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text("serve:\n  port: 9000\n  log-format: json\n")
    args = parsed(["serve"], read_config(str(yaml_file)))
    assert args.port == 9000 and args.log_format == "json"
    broken = tmp_path / "s.toml"
    broken.write_text("port = = 1")
    with pytest.raises(ValueError, match="not valid TOML"):
        read_config(str(broken))
    with pytest.raises(ValueError, match="no such file"):
        read_config(str(tmp_path / "missing.toml"))


def run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamgrok", *argv], capture_output=True,
                          text=True, timeout=120, env=env)


def test_wrong_options_fail_before_the_model_loads(tmp_path):
    # no model file exists at this path: getting past the checks would fail differently
    missing_model = str(tmp_path / "absent.gguf")
    policy = run_cli("serve", "--kv-policy", "bogus", "--model", missing_model)
    assert policy.returncode == 2 and "invalid choice: 'bogus'" in policy.stderr
    pipeline = run_cli("serve", str(tmp_path / "nope.py"), "--model", missing_model)
    assert pipeline.returncode == 2 and "pipeline file not found" in pipeline.stderr
    assert "live_qa" in pipeline.stderr and "Traceback" not in pipeline.stderr
    config = tmp_path / "c.toml"
    config.write_text('[serve]\nkv-policy = "nonsense"\n')
    bad = run_cli("--config", str(config), "serve", "--model", missing_model)
    assert bad.returncode == 2 and "nonsense" in bad.stderr
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("streamgrok ")


def test_a_busy_port_is_one_line_not_a_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--port", str(port), "--load-tick", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == \
        f"streamgrok: error: cannot listen on 127.0.0.1:{port}: the port is in use"


def test_sample_pipelines_are_packaged_and_named_by_name():
    assert Path(resolve_pipeline("live_qa")).name == "live_qa.py"
    assert resolve_pipeline("pipelines/alert.py") == "pipelines/alert.py"
    with pytest.raises(ValueError, match="alert, commentary, live_qa"):
        resolve_pipeline("nonexistent")


def test_the_package_list_covers_every_package_and_the_policies_match():
    from streamgrok.cache.config import POLICIES as CACHE_POLICIES

    assert POLICIES == CACHE_POLICIES
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in
             root.glob("streamgrok/**/__init__.py")}
    kernels = {".".join(("streamgrok_kernels", *p.parent.relative_to(root).parts[1:]))
               for p in root.glob("kernels/**/__init__.py")}  # installed under our name
    assert found | kernels | {"streamgrok.pipelines"} == listed
