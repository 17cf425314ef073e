"""spooler-node refuses settings it could never honour, at start, with a clear message."""
import pytest

import asyncio

from node.api import grpc_api
from node.main import _parse_peers, parse_args, serve


@pytest.mark.parametrize("argv, words", [
    (["--max-body-bytes", "0"], "--max-body-bytes must be 1..8388608"),
    # a body is one log record of at most 8 MiB; more could never be sent
    (["--max-body-bytes", "8388609"], "--max-body-bytes must be 1..8388608"),
    (["--log-keep-records", "0"], "--log-keep-records must be >= 1"),
    (["--max-messages", "0"], "--max-messages must be 1..1000000000"),
    (["--max-messages", "1000000001"], "--max-messages must be 1..1000000000"),
    (["--max-dedup-keys", "0"], "--max-dedup-keys must be 1..1000000000"),
    (["--log-keep-bytes", "-1"], "--log-keep-bytes must be >= 0"),
    (["--http-max-connections", "0"], "--http-max-connections must be 1..1000000"),
    (["--http-max-connections", "1000001"], "--http-max-connections must be 1..1000000"),
    (["--http-client-timeout", "0"], "--http-client-timeout must be 0.1..3600 seconds"),
    (["--http-client-timeout", "nan"], "--http-client-timeout must be 0.1..3600 seconds"),
    (["--http-client-timeout", "inf"], "--http-client-timeout must be 0.1..3600 seconds"),
    (["--grpc-max-connections", "0"], "--grpc-max-connections must be 1..1000000"),
    (["--grpc-max-connections", "1000001"], "--grpc-max-connections must be 1..1000000"),
    (["--grpc-handshake-timeout", "0.05"], "--grpc-handshake-timeout must be 0.1..3600 seconds"),
    (["--grpc-handshake-timeout", "nan"], "--grpc-handshake-timeout must be 0.1..3600 seconds"),
    (["--grpc-handshake-timeout", "inf"], "--grpc-handshake-timeout must be 0.1..3600 seconds"),
    # a key no Authorization header can carry (over 512 characters, or with a space)
    (["--admin-key", "k" * 513], "--admin-key must be 1..512 printable ASCII"),
    (["--admin-key", " padded"], "--admin-key must be 1..512 printable ASCII"),
    (["--admin-key", "bell\x07"], "--admin-key must be 1..512 printable ASCII"),
    (["--admin-key", "caf\u00e9"], "--admin-key must be 1..512 printable ASCII"),  # gRPC metadata cannot carry it
    (["--admin-key", "tab\tinside"], "--admin-key must be 1..512 printable ASCII"),
    (["--cluster-key", " padded"], "--cluster-key must be 1..512 printable ASCII"),
    (["--cluster-key", "k" * 513], "--cluster-key must be 1..512 printable ASCII"),
    (["--failover-timeout", "0"], "--failover-timeout must be > 0"),
    # nan and inf passed the "> 0" check and then failed with a traceback
    (["--failover-timeout", "nan"], "--failover-timeout must be 0.1..3600 seconds"),
    (["--failover-timeout", "inf"], "--failover-timeout must be 0.1..3600 seconds"),
    (["--failover-timeout", "1e-9"], "--failover-timeout must be 0.1..3600 seconds"),
    (["--failover-timeout", "3600.5"], "--failover-timeout must be 0.1..3600 seconds"),
    # an id names the node in --peers (ID=HOST:PORT,...) and in /v1/cluster
    (["--id", ""], "--id must match [A-Za-z0-9._-]{1,64}"),
    (["--id", "bad id"], "--id must match [A-Za-z0-9._-]{1,64}"),
    (["--id", "n=1"], "--id must match [A-Za-z0-9._-]{1,64}"),
    (["--id", "n" * 65], "--id must match [A-Za-z0-9._-]{1,64}"),
    (["--log-level", "LOUD"], "--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    (["--data", ""], "--data must name a directory"),
    (["--eager-replicas", "some"], "--eager-replicas must be quorum or all, not 'some'"),
    (["--eager-replicas", "Quorum"], "--eager-replicas must be quorum or all"),
    # a replacement with no cluster named would serve as a lone primary at once
    (["--join"], "--join (SPOOLER_JOIN) replaces a member of a cluster"),
    (["--join", "--peers", "n1=127.0.0.1:1"], "--join (SPOOLER_JOIN) replaces a member of a cluster"),
])
def test_a_setting_out_of_range_stops_the_node_at_start(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_a_refused_setting_is_one_line_not_the_usage_block(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--failover-timeout", "0.01"])
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0, err
    assert err.startswith("spooler-node: error: --failover-timeout must be") and "--help" in err


@pytest.mark.parametrize("value, join", [("", False), ("0", False), ("false", False), ("No", False),
                                         ("off", False), ("1", True), ("true", True), ("YES", True), ("on", True)])
def test_spooler_join_reads_the_usual_words_for_yes_and_no(monkeypatch, value, join):
    """SPOOLER_JOIN=false once turned --join on (any value but empty or 0 did): a
    manifest saying so left a new cluster's every node unable to vote."""
    monkeypatch.setenv("SPOOLER_JOIN", value)
    assert parse_args(["--peers", "n1=127.0.0.1:1,n2=127.0.0.1:2"]).join is join


def test_eager_replicas_defaults_to_quorum_and_reads_its_variable(monkeypatch, capsys):
    monkeypatch.delenv("SPOOLER_EAGER_REPLICAS", raising=False)
    assert parse_args([]).eager_replicas == "quorum"
    monkeypatch.setenv("SPOOLER_EAGER_REPLICAS", "all")
    assert parse_args([]).eager_replicas == "all"
    assert parse_args(["--eager-replicas", "quorum"]).eager_replicas == "quorum"  # the flag wins
    monkeypatch.setenv("SPOOLER_EAGER_REPLICAS", "half")
    with pytest.raises(SystemExit) as e:
        parse_args([])
    assert e.value.code == 2 and "--eager-replicas must be quorum or all, not 'half'" in capsys.readouterr().err


def test_a_spooler_join_that_is_neither_yes_nor_no_stops_the_node(monkeypatch, capsys):
    monkeypatch.setenv("SPOOLER_JOIN", "maybe")
    with pytest.raises(SystemExit) as e:
        parse_args(["--peers", "n1=127.0.0.1:1,n2=127.0.0.1:2"])
    assert e.value.code == 2 and "SPOOLER_JOIN must be one of" in capsys.readouterr().err


def test_a_data_path_that_is_a_file_stops_the_node_at_start(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        parse_args(["--data", str(f)])
    assert e.value.code == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_a_data_directory_that_cannot_be_made_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "afile").write_text("")
    args = parse_args(["--data", str(tmp_path / "afile" / "sub"), "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
                       "--admin-key", "k"])
    with pytest.raises(SystemExit) as e:
        asyncio.run(serve(args))
    assert str(e.value).startswith("spooler-node: cannot make the data directory")


def test_a_peer_id_that_could_not_be_a_node_id_is_refused():
    with pytest.raises(SystemExit) as e:
        _parse_peers("n1=127.0.0.1:1,bad id=127.0.0.1:2", "n1")
    assert "--peers ids must match" in str(e.value)


def test_the_edges_of_those_ranges_are_accepted(monkeypatch):
    monkeypatch.delenv("SPOOLER_ADMIN_KEY", raising=False)
    a = parse_args(["--max-body-bytes", "8388608", "--log-keep-records", "1", "--log-keep-bytes", "0",
                    "--admin-key", "k" * 512, "--admin-key", "two words"])
    assert (a.max_body_bytes, a.log_keep_records, a.log_keep_bytes, a.admin_key) == (
        8388608, 1, 0, ["k" * 512, "two words"])
    for ft in ("0.1", "3600"):
        assert parse_args(["--failover-timeout", ft]).failover_timeout == float(ft)
    for m in ("1", "1000000000"):
        assert parse_args(["--max-messages", m]).max_messages == int(m)
    monkeypatch.setenv("SPOOLER_MAX_MESSAGES", "123")
    assert parse_args([]).max_messages == 123
    monkeypatch.setenv("SPOOLER_MAX_DEDUP_KEYS", "45")
    assert parse_args([]).max_dedup_keys == 45
    monkeypatch.setenv("SPOOLER_GRPC_MAX_CONNECTIONS", "7")
    monkeypatch.setenv("SPOOLER_GRPC_HANDSHAKE_TIMEOUT", "0.25")
    a = parse_args([])
    assert (a.grpc_max_connections, a.grpc_handshake_timeout) == (7, 0.25)
    assert ("grpc.max_allowed_incoming_connections", 7) in grpc_api.server_options(7, 0.25)
    assert ("grpc.server_handshake_timeout_ms", 250) in grpc_api.server_options(7, 0.25)
    assert parse_args(["--id", "A-z.0_" + "n" * 58, "--log-level", "debug"]).id == "A-z.0_" + "n" * 58


def test_admin_keys_from_the_environment_may_have_spaces_around_their_commas(monkeypatch):
    monkeypatch.setenv("SPOOLER_ADMIN_KEY", " key-one-aaaa , key-two-bbbb,,key-three ")
    assert parse_args([]).admin_key == ["key-one-aaaa", "key-two-bbbb", "key-three"]
    monkeypatch.setenv("SPOOLER_ADMIN_KEY", "two words, inside")  # a space inside a key is the key's own
    assert parse_args([]).admin_key == ["two words", "inside"]


def test_admin_keys_from_the_environment_are_checked_too(monkeypatch, capsys):
    monkeypatch.setenv("SPOOLER_ADMIN_KEY", "good," + "k" * 600)
    with pytest.raises(SystemExit):
        parse_args([])
    assert "--admin-key must be" in capsys.readouterr().err


@pytest.mark.parametrize("var, value, words", [
    ("SPOOLER_FAILOVER_TIMEOUT", "abc", "argument --failover-timeout: invalid float value: 'abc'"),
    ("SPOOLER_MAX_BODY_BYTES", "1k", "argument --max-body-bytes: invalid int value: '1k'"),
    ("SPOOLER_LOG_KEEP_RECORDS", "many", "argument --log-keep-records: invalid int value"),
    ("SPOOLER_LOG_KEEP_BYTES", "1.5", "argument --log-keep-bytes: invalid int value"),
])
def test_a_malformed_environment_variable_is_a_usage_error_not_a_traceback(monkeypatch, capsys, var, value, words):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        parse_args([])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_numbers_from_the_environment_are_numbers(monkeypatch):
    monkeypatch.setenv("SPOOLER_FAILOVER_TIMEOUT", "0.5")
    monkeypatch.setenv("SPOOLER_LOG_KEEP_BYTES", "1024")
    monkeypatch.setenv("SPOOLER_JOIN", "1")
    a = parse_args(["--peers", "n1=127.0.0.1:1,n2=127.0.0.1:2"])
    assert (a.failover_timeout, a.log_keep_bytes, a.join) == (0.5, 1024, True)


def test_a_node_process_takes_grpcs_older_io_path_before_grpc_is_imported():
    from node.process import GRPC_IO_LEGACY, prepare
    env: dict = {}
    assert prepare(env, modules={}) == "legacy" and env["GRPC_EXPERIMENTS"] == GRPC_IO_LEGACY
    # an operator's own setting is left alone, and so is the opt-out
    env = {"GRPC_EXPERIMENTS": "-something"}
    assert prepare(env, modules={}) == "operator" and env["GRPC_EXPERIMENTS"] == "-something"
    env = {"SPOOLER_GRPC_IO": "default"}
    assert prepare(env, modules={}) == "default" and "GRPC_EXPERIMENTS" not in env
    # once grpc is imported the setting would be ignored: it says so instead of pretending
    env = {}
    assert prepare(env, modules={"grpc": object()}) == "too late" and "GRPC_EXPERIMENTS" not in env


def test_an_unknown_grpc_io_choice_stops_the_node_after_the_flags(monkeypatch, capsys):
    from node.main import main
    from node.process import prepare
    env = {"SPOOLER_GRPC_IO": "fast"}
    assert prepare(env, modules={}) == "invalid" and "GRPC_EXPERIMENTS" not in env
    monkeypatch.setenv("SPOOLER_GRPC_IO", "fast")
    with pytest.raises(SystemExit) as e:
        main(["--help"], grpc_io="invalid")
    assert e.value.code == 0 and "--failover-timeout" in capsys.readouterr().out  # help still answers
    with pytest.raises(SystemExit) as e:
        main(["--id", "n1"], grpc_io="invalid")
    assert str(e.value) == "spooler-node: SPOOLER_GRPC_IO must be one of legacy, default, not 'fast'"


def test_addresses_ipv6_in_brackets_and_ports_in_ascii_digits_up_to_65535():
    """gRPC dials and listens on an IPv6 address only in brackets: a peer written
    bare (::1:P) is kept bracketed, as the node's own --grpc is; a port of other
    scripts' digits or past 65535 is refused at start, not a traceback."""
    from node.main import _hostport, _join, _parse_peers
    assert _parse_peers("n1=::1:27061,n2=[::1]:27062,n3=127.0.0.1:27063", "n1") == {
        "n1": "[::1]:27061", "n2": "[::1]:27062", "n3": "127.0.0.1:27063"}
    assert _join(*_hostport("[::]:50051")) == "[::]:50051" and _join(*_hostport("localhost:1")) == "localhost:1"
    for bad in ("127.0.0.1:\u00b2", "127.0.0.1:65536", "127.0.0.1:", ":80"):
        with pytest.raises(SystemExit):
            _hostport(bad)
