"""The one table of settings (lb/config/schema.py): the README's configuration table, --help's defaults,
conf/edge.toml and the unknown-key errors all say what the table says, and the names operators rely on
are still there. No processes: these read the table and the files."""

import re
import subprocess
from pathlib import Path

import pytest

from lb.config import docs
from lb.config import load as config
from lb.config.kinds import Bool
from lb.config.schema import SETTINGS, Config, file_keys
from lb.errors import ConfigError
from tests.support import PY, ROOT

README = Path(ROOT) / "docs" / "reference" / "configuration.md"   # the generated table lives there

# The flags and TOML keys of main before the table (DESIGN.md's contract, the README, tests and unit files use
# them): a rename breaks someone. Add to these lists; never take a name out.
FLAGS = """--config --listen --backends --strategy --sticky --health-path --health-interval --health-timeout
--unhealthy-threshold --healthy-threshold --eject-after --eject-for --max-ejected-percent --slow-start --connect-timeout
--read-timeout --response-timeout --pool-maxsize --pool-timeout --pool-idle-timeout --proxy-buffering
--max-temp-file-size --no-pool --retries --retry-budget-percent --retry-budget-min --max-requests --max-pending
--resolver --resolve-interval --retry-on --per-try-timeout --workers --takeover --cpu-affinity --drain-timeout --grace
--max-connections --allow-underscores --header-timeout --body-timeout --body-min-rate --send-timeout
--keepalive-timeout --max-body-size --request-buffering --buffer-memory --temp-dir --tls-cert --tls-key
--tls-min-version --tls-ciphers --tls-client-ca --ca-file --tunnel-idle-timeout --upgrades --limit --key-limit
--algorithm --store --redis-timeout --on-store-error --ipv6-prefix --max-delay --max-in-flight --limit-status
--trusted-proxies --admin --request-id-response --access-log --access-log-format --check --demo""".split()
TOML_KEYS = """listen admin strategy demo access_log access_log_format sticky backends rules keys admin.listen
admin.token_file admin.allowed_hosts health.path health.interval health.timeout health.unhealthy_threshold
health.healthy_threshold health.eject_after health.eject_for health.max_ejected_percent health.slow_start
upstream.connect_timeout upstream.read_timeout upstream.response_timeout upstream.pool_maxsize upstream.pool_timeout
upstream.pool_idle_timeout upstream.no_pool upstream.ca_file upstream.retries upstream.retry_budget_percent
upstream.retry_budget_min upstream.max_requests upstream.max_pending upstream.resolver upstream.resolve_interval
upstream.retry_on upstream.per_try_timeout upstream.proxy_buffering upstream.max_temp_file_size server.workers
server.cpu_affinity server.drain_timeout server.grace server.max_connections server.header_timeout
server.body_timeout server.keepalive_timeout server.body_min_rate server.send_timeout server.max_body_size
server.tunnel_idle_timeout server.upgrades server.request_id_response server.allow_underscores
server.request_buffering server.buffer_memory server.temp_dir server.log_redact_params tls.cert tls.key tls.ciphers
tls.min_version tls.certificates tls.strict_sni tls.client_ca tls.client_auth tls.client_crl limits.default
limits.algorithm limits.store limits.redis_timeout limits.on_store_error limits.redis_password_file
limits.redis_ca_file limits.redis_cert_file limits.redis_key_file limits.trusted_proxies limits.keys
limits.api_keys_file limits.unknown_keys limits.exempt limits.ietf_headers limits.tiers limits.max_keys
limits.ipv6_prefix limits.max_delay limits.max_delayed limits.max_in_flight limits.status""".split()


def test_the_readme_table_is_the_one_the_schema_generates():
    table = docs.readme_table(README.read_text(encoding="utf-8"))
    assert table is not None, f"docs/reference/configuration.md lost its markers {docs.BEGIN!r} ... {docs.END!r}"
    assert table == docs.markdown(), ("docs/reference/configuration.md's table and lb/config/schema.py disagree: "
                                      "run `python3 -m lb.config.docs --write docs/reference/configuration.md`")


def test_a_changed_readme_row_is_caught():
    text = README.read_text(encoding="utf-8").replace("| `--listen HOST:PORT` | `listen` | `127.0.0.1:8080` |",
                                                      "| `--listen HOST:PORT` | `listen` | `127.0.0.1:9999` |")
    assert docs.readme_table(text) != docs.markdown()


def test_the_markdown_command_prints_the_table():
    p = subprocess.run([PY, "-m", "lb.config.docs", "--markdown"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout == docs.markdown(), p.stderr


def test_no_flag_or_toml_key_of_before_the_table_is_gone():
    flags = set(config.build_argparser()._option_string_actions)
    assert [f for f in FLAGS if f not in flags] == []
    paths = {f"{section}.{key}" if section else key for section, keys in file_keys().items() for key in keys}
    assert [k for k in TOML_KEYS if k not in paths] == []


def test_every_flag_and_key_is_one_setting():
    flags = [s.flag for s in SETTINGS if s.flag]
    paths = [p for s in SETTINGS for p in s.toml]
    assert len(flags) == len(set(flags)) and len(paths) == len(set(paths))
    argparse_flags = {o for a in config.build_argparser()._actions for o in a.option_strings}
    assert argparse_flags - set(flags) == {"-h", "--help", "--version"}


def test_config_defaults_are_the_table_defaults():
    c = Config()
    for s in SETTINGS:
        assert getattr(c, s.name) == s.default, s.name


def test_help_shows_every_default_from_the_table():
    out = re.sub(r"\s+", " ", config.build_argparser().format_help())
    for s in SETTINGS:
        if not s.flag or isinstance(s.kind, Bool) or not docs.default_text(s):
            continue
        shown = docs.default_text(s).replace("`", "")
        assert f"(default {shown})" in out, (s.flag, shown)
    assert "(default 10)" in out and "(default 127.0.0.1:8080)" in out and "(default token-bucket)" in out


def test_every_setting_says_what_it_does_and_names_its_choices():
    for s in SETTINGS:
        assert s.flag or s.toml, s.name
        assert (s.help if s.flag else s.doc), f"{s.name}: a flag needs help, a file-only key a doc"
        for choice in s.choices:
            assert choice in s.help + (s.doc or ""), (s.name, choice)


@pytest.mark.parametrize("path", sorted({p for s in SETTINGS for p in s.toml}))
def test_conf_edge_toml_shows_every_key(path):
    """The example file documents every key (set or commented out), in its own table."""
    section, _, key = path.rpartition(".")
    text = (Path(ROOT) / "conf" / "edge.toml").read_text()
    if section:
        parts = re.split(r"(?m)^#? ?\[\[?([a-z_.]+)\]\]?", text)
        bodies = [parts[i + 1] for i in range(1, len(parts) - 1, 2) if parts[i] == section]
        header = re.search(rf"(?m)^#? ?\[\[?{re.escape(path)}\]\]?", text)
        assert header or any(re.search(rf"(?m)^#? ?{key} =", b) for b in bodies), path
    else:
        top = re.split(r"(?m)^\[", text)[0]
        assert re.search(rf"(?m)^#? ?\[\[?{key}\]\]?|^#? ?{key} =", text if key in ("backends", "rules", "keys")
                         else top), path


def test_unknown_keys_are_named_with_the_known_ones(tmp_path):
    f = tmp_path / "edge.toml"
    f.write_text('listn = "x"\n[[backends]]\nurl = "http://127.0.0.1:9"\n[health]\nintervall = 1\n')
    with pytest.raises(ConfigError) as e:
        config.load(["--config", str(f)])
    assert e.value.problems == [
        ("listn: unknown key (known at the top level: listen, admin, strategy, demo, access_log, access_log_format, "
         "sticky, backends, rules, keys, health, upstream, server, tls, limits)"),
        ("health.intervall: unknown key (known in [health]: path, protocol, interval, timeout, unhealthy_threshold, "
         "healthy_threshold, eject_after, eject_for, max_ejected_percent, slow_start)")]
